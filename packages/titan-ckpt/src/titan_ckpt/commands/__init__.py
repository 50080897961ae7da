"""The ``titan-ckpt`` command and the library functions behind its subcommands:
``inspect_path``, ``verify_path``, ``diff_paths`` and ``convert`` read any checkpoint through
``source.open_source``; ``cli.main`` is the command.
"""
