"""The ``titan-ckpt`` command and the library functions behind its subcommands.

``inspect_path``, ``verify_path``, ``diff_paths`` and ``convert`` (with ``ConvertOptions``)
read any checkpoint through ``titan_ckpt.formats``; ``cli.main`` is the command.
"""
