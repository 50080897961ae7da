"""Checkpoint formats, each one module of readers and writers over paths and file objects;
nothing here imports the runtime above it (only ``titan_ckpt.errors``).

``base`` (``Entry``, ``Source``, ``batches``), ``dcp``, ``safetensors``, ``torch_save``,
``pickles`` (the restricted unpickler), ``checksums`` and ``hashing`` (hashing DCP writers).
"""
