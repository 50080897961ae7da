"""``TrainState``: what the loop itself must remember across a restart."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["TrainState"]

logger = logging.getLogger("titan_train")


@dataclass
class TrainState:
    """What the loop itself must remember across a restart (a ``Stateful`` checkpointed as
    ``train_state``)."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        if "tokens_seen" in state:
            self.tokens_seen = int(state["tokens_seen"])
        elif "ntokens_seen" in state:  # torchtitan's name (it saves one rank's count)
            self.tokens_seen = int(state["ntokens_seen"])
        else:  # torchtitan before August 2025 kept no token count
            logger.warning("The checkpoint records no token count: counting tokens from 0")
            self.tokens_seen = 0
