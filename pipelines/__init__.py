"""Driver pipelines: the Ray engine (engine, its actors, their recovery, the cluster), the training loops built on it,
and the command line that drives them (cli, doctor)."""
