"""Driver pipelines: the Ray engine and the training loops built on it."""
