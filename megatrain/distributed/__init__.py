"""Several processes: joining a torch.distributed group (process_group.py), data parallelism between executors
(data_parallel.py), and keeping several nodes' weights equal (node_exchange.py)."""
