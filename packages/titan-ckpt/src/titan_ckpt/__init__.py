"""titan-ckpt: a checkpoint manager for PyTorch pretraining.

``CheckpointManager`` saves the model parts (flattened by fully-qualified name, so checkpoints
reshard across parallel layouts) and any ``Stateful`` states as DCP checkpoints in
``<folder>/step-<N>/``; a step becomes loadable only when its commit marker, which holds a
manifest of file sizes and checksums, is written. ``StateDictAdapter`` (and its
tensor-by-tensor form, ``StreamingStateDictAdapter``) is the seam through which model
packages provide Hugging Face conversion.

A step directory titan did not create is never deleted, overwritten or written into:
``titan_ckpt.layout.classify_step`` tells ours from torchtitan's and foreign ones,
``check_folder_contents`` stops a run early on a folder it cannot use safely, and
torchtitan checkpoints resume through ``TorchtitanCompat``. One run writes a folder at a
time: ``lock_checkpoint_folder`` (``titan_ckpt.lock``), which a saving manager takes itself.

Every error raised on purpose is a ``CheckpointError`` (``titan_ckpt.errors``). The layers
(runtime, ``formats``, ``commands``) are described in the package's README.
"""

from titan_ckpt.__about__ import __version__
from titan_ckpt.adapter import (
    ADAPTER_ENTRY_POINT_GROUP,
    StateDictAdapter,
    StreamingStateDictAdapter,
    load_state_dict_adapter,
)
from titan_ckpt.config import CheckpointConfig
from titan_ckpt.errors import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointLockError,
    CheckpointReadError,
    CheckpointWriteError,
    DiskFullError,
    UnsafeCheckpointError,
)
from titan_ckpt.ft import FaultToleranceOptions
from titan_ckpt.layout import MODEL_RECORD
from titan_ckpt.load_plan import Loaded
from titan_ckpt.lock import lock_checkpoint_folder
from titan_ckpt.manager import CheckpointManager
from titan_ckpt.preflight import check_folder_contents, check_folder_writable
from titan_ckpt.states import ModelState, OptimizerState
from titan_ckpt.storage import FsspecStorage, LocalStorage, Storage, storage_for
from titan_ckpt.torchtitan import TorchtitanCompat, is_torchtitan_checkpoint

__all__ = [
    "ADAPTER_ENTRY_POINT_GROUP",
    "MODEL_RECORD",
    "CheckpointConfig",
    "CheckpointConfigError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointIntegrityError",
    "CheckpointLockError",
    "CheckpointManager",
    "CheckpointReadError",
    "CheckpointWriteError",
    "DiskFullError",
    "FaultToleranceOptions",
    "FsspecStorage",
    "Loaded",
    "LocalStorage",
    "ModelState",
    "OptimizerState",
    "StateDictAdapter",
    "Storage",
    "StreamingStateDictAdapter",
    "TorchtitanCompat",
    "UnsafeCheckpointError",
    "__version__",
    "check_folder_contents",
    "check_folder_writable",
    "is_torchtitan_checkpoint",
    "load_state_dict_adapter",
    "lock_checkpoint_folder",
    "storage_for",
]
