"""The trainer: the loop (``loop``: ``run``, ``train``), what it builds (``build``), one step
(``step``), validation, preemption, profiling and the host-memory checks it runs on.

Submodules import on their own: ``titan_train.config`` reads ``trainer.profiling``'s section
without loading the loop.
"""
