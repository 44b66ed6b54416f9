"""Performance: measuring this machine once (calibrate.py; the optimizer pool alone and beside copies in
optimizer_timing.py) and predicting a run's step time from it (predict.py).

    cal = Calibration.load(device_name("cpu")) or calibrate("cpu", config, batch=2, seq=256)  # cached as JSON
    pred = predict(plan_run(config, 2, 256), config, cal)                                     # pred.step_s, pred.bound

`megatrain calibrate` and `megatrain plan` both measure through megatrain.perf.calibrate.calibrate.
"""
