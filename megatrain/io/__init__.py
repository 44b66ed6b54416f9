"""I/O: checkpoint files on disk (checkpoint.py): HF model directories in and out, resumable training checkpoints."""
