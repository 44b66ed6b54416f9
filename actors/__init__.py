"""Thin Ray actor shells over megatrain's plain classes; the only place besides pipelines/ that imports ray."""
