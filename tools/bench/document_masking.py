"""Training-step speed with document masking off and on, beside the plain model path.

Times forward + backward of one titan-models family (Llama 3, Qwen3 or DeepSeek-V3) in one
process on random packed windows (an EOS every ``--doc-len`` tokens on average), three ways
interleaved in each round (baseline, off, on, on, off, baseline: a linear drift of the
machine's speed cancels):

- ``baseline``: ``model(tokens)``, the path every run took before document masking;
- ``off``: ``model(tokens, document_ids=None, positions=None)``, what a caller forwarding the
  keywords with masking off runs; it must read 1.00x;
- ``on``: document ids and restarting positions computed from the tokens each step (as the
  trainer does), the block-causal mask (SDPA's boolean mask on the CPU, FlexAttention's block
  mask where ``flex_attention_supported`` says so).

    python tools/bench/document_masking.py                        # llama3 debugmodel, seq 512
    python tools/bench/document_masking.py --model qwen3 --seq 1024 --doc-len 64

For the model path of another commit side by side, ``compare_commits.py``. Threads:
torch's default unless ``--threads``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional

from titan_models.deepseek_v3 import DeepSeekV3, deepseek_v3_args
from titan_models.documents import DocumentMasking, flex_attention_supported
from titan_models.llama3 import Llama3, llama3_args
from titan_models.qwen3 import Qwen3, qwen3_args

MODELS = {
    "llama3": (Llama3, llama3_args),
    "qwen3": (Qwen3, qwen3_args),
    "deepseek_v3": (DeepSeekV3, deepseek_v3_args),
}
EOS = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3", choices=sorted(MODELS))
    parser.add_argument("--flavor", default="debugmodel", help="a flavor of the model")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--doc-len", type=int, default=128, help="mean tokens per document")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting and round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", default=None, help="default: cuda if there, else cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    cls, make_args = MODELS[args.model]
    model_args = make_args(args.flavor, max_seq_len=args.seq)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(model_args)
    model.init_weights()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        1, model_args.vocab_size, (args.batch, args.seq + 1), generator=generator
    )
    ends = torch.rand(tokens.shape, generator=generator) < 1 / args.doc_len
    tokens = tokens.masked_fill(ends, EOS).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    masking = DocumentMasking(EOS)

    def kwargs_of(setting: str) -> dict[str, torch.Tensor | None]:
        if setting == "baseline":
            return {}
        if setting == "off":
            return {"document_ids": None, "positions": None}
        return masking.forward_kwargs(inputs)

    def step(setting: str) -> None:
        logits = model(inputs, **kwargs_of(setting))
        loss = functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)

    def timed(setting: str) -> float:
        if device.type != "cpu":
            torch.accelerator.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(setting)
        if device.type != "cpu":
            torch.accelerator.synchronize()
        return (time.perf_counter() - start) / args.steps

    for setting in ("baseline", "on"):  # untimed: one-time costs (allocator, kernels, compile)
        step(setting)
    seconds: dict[str, list[float]] = {"baseline": [], "off": [], "on": []}
    for _ in range(args.rounds):
        for setting in ("baseline", "off", "on", "on", "off", "baseline"):
            seconds[setting].append(timed(setting))

    docs = float(ends[:, :-1].sum(dim=1).float().mean()) + 1
    mask = "FlexAttention block mask" if flex_attention_supported(device.type) else "SDPA bool mask"
    print(
        f"{args.model} {args.flavor} on {device.type}: batch {args.batch} x seq {args.seq}, "
        f"~{docs:.0f} documents per window, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}; masking on uses the {mask}"
    )
    base = statistics.mean(seconds["baseline"])
    tokens_per_step = args.batch * args.seq
    print(f"{'setting':<10}{'s/step':>9}{'tokens/s':>10}{'speed vs baseline':>19}")
    for setting, values in seconds.items():
        mean = statistics.mean(values)
        print(f"{setting:<10}{mean:>9.4f}{tokens_per_step / mean:>10.0f}{base / mean:>18.2f}x")


if __name__ == "__main__":
    main()
