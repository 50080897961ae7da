"""Checkpoint formats, each in one module used by both its readers and its writers.

- ``base``: ``Entry``, ``Source``, ``batches`` and the helpers every format shares;
- ``source``: ``detect`` a path's format and ``open_source`` a reader for it;
- ``dcp``: DCP's restricted readers, ``DcpSource`` and the streaming DCP writer;
- ``safetensors``: the header reader, the lazy tensor reader, ``SafetensorsSource``, the
  sharded writer and the non-tensor codec;
- ``torch_save``: ``TorchSource`` and the streaming ``torch.save`` writer;
- ``pickles``: the restricted unpickler for the pickles inside checkpoints.
"""
