"""Worker of test_dp_resume: one gloo rank's dataloader at dp = world size, saved or
resumed through titan-ckpt's CheckpointManager (a real distributed checkpoint).

    torchrun --nproc-per-node N dp_resume.py {save|load} CORPUS FOLDER OUT STEPS
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from titan_ckpt import CheckpointConfig, CheckpointManager
from titan_train.data import DataConfig, TextDataLoader, open_documents
from titan_train.tokenizer import load_tokenizer


def main() -> None:
    mode, corpus, folder, out, steps = sys.argv[1:6]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    texts: list[str] = []
    tokenizer = load_tokenizer()

    class Recording:  # the real tokenizer, recording the texts it encodes
        bos_id, eos_id, vocab_size = tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size

        def encode(self, text, *, bos=False, eos=False):
            texts.append(text)
            return tokenizer.encode(text, bos=bos, eos=eos)

    loader = TextDataLoader(
        open_documents(DataConfig(dataset=corpus)), Recording(), seq_len=16,
        local_batch_size=2, dp_rank=rank, dp_degree=world, num_shards=8, prefetch=2,
    )  # fmt: skip
    torch.manual_seed(0)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=folder),
        model_parts=nn.Linear(2, 2),
        states={"dataloader": loader},  # its dp_degree (world) is recorded with the step
    )
    if mode == "load":
        assert manager.load()
    batches = list(itertools.islice(loader, int(steps)))
    if mode == "save":
        manager.save(1, force=True)
    manager.close()
    loader.close()
    rows = [row for inputs, labels in batches
            for row in torch.cat([inputs, labels[:, -1:]], dim=1).tolist()]  # fmt: skip
    with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump({"windows": rows, "texts": texts}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
