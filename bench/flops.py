"""How fast the machine multiplies matrices, and how many FLOPs a GRPO step needs at least.

Together they give a step's *floor*: the seconds it would take if every FLOP the model's shapes
require ran at the machine's measured matmul peak. ``step seconds / floor seconds`` then says how
far an implementation is from the hardware, independently of how long its samples happened to be.

FLOPs are counted from the model config, for a decoder-only transformer with grouped-query
attention and a gated (SwiGLU) MLP, as Llama, SmolLM2 and Qwen are. With hidden size ``h``,
MLP width ``i``, ``L`` layers, ``n_q`` query heads, ``n_kv`` key/value heads, head width
``d = h / n_q`` (or the config's ``head_dim``) and vocabulary ``V``::

    N_layer = h * n_q * d              (q projection)
            + 2 * h * n_kv * d         (k and v projections)
            + n_q * d * h              (o projection)
            + 3 * h * i                (gate, up and down projections)
    N       = L * N_layer + h * V      (non-embedding matmul params + the lm_head)

Norms, rotary embeddings, activations and the embedding lookup are not matmuls and are left out.
A token that attends to ``c`` positions (itself and those before it) costs, per forward pass,
``2 * N`` for the matmuls with weights plus ``4 * L * n_q * d * c`` for the attention scores
(``q . k`` over ``c`` keys, then the weighted sum of ``c`` values, two FLOPs per multiply-add).

    generation  each generated token: 2 * N + 4 * L * n_q * d * c    (forward only; c is its
                position in prompt + response, counting from 1)
                each distinct prompt, prefilled once: the same per prompt token
    training    each trained token (prompt and response, padding excluded):
                6 * N + 12 * L * n_q * d * c                          (forward + backward = 3x)

The training count charges the lm_head on prompt tokens too, although only response tokens
need logits: the floor is a count of the step's shapes, not of any one implementation's tricks.

Run as a script, it measures the peaks and records them (``bench/results/flops/``):

    python bench/flops.py              # the real run: 1536-wide products, best of 5
    python bench/flops.py --smoke      # small products once, nothing written
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """The config numbers that decide a transformer's FLOPs."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers ``PretrainedConfig`` (or anything with the same attributes)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
        )

    @property
    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        attention = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        return attention + 3 * h * self.intermediate

    @property
    def matmul_params(self) -> int:
        """``N``: every layer's matmul weights plus the lm_head's."""
        return self.layers * self.layer_params + self.hidden * self.vocab

    def forward_flops(self, first: int, last: int) -> float:
        """Forward FLOPs of the tokens at positions ``first .. last`` (1-based, inclusive) of
        one sequence, each attending to itself and everything before it."""
        count = last - first + 1
        if count <= 0:
            return 0.0
        attended = (first + last) * count / 2  # sum of c over the positions
        return 2.0 * self.matmul_params * count + 4.0 * self.layers * self.heads * (
            self.head_dim * attended
        )


def step_flops(
    shape: ModelShape, sequences: Iterable[tuple[int, int]], prompt_lengths: Iterable[int]
) -> dict[str, float]:
    """The FLOPs a GRPO step needs: ``generate`` (prefill of each of ``prompt_lengths`` once,
    then every response token), ``train`` (every token of every sequence) and ``total``.

    ``sequences`` holds ``(prompt_tokens, response_tokens)`` of each sample; ``prompt_lengths``
    the token count of each distinct prompt of the step (one per group).
    """
    generate = sum(shape.forward_flops(1, n) for n in prompt_lengths)
    train = 0.0
    for prompt, response in sequences:
        generate += shape.forward_flops(prompt + 1, prompt + response)
        train += 3.0 * shape.forward_flops(1, prompt + response)
    return {"generate": generate, "train": train, "total": generate + train}


def matmul_peak_gflops(
    dtype: torch.dtype, size: int = 1536, repeats: int = 5, calls: int = 4
) -> float:
    """Best observed GFLOP/s of ``size x size`` matmuls in ``dtype`` on the CPU.

    Each of ``repeats`` timings runs ``calls`` matmuls back to back (``2 * size**3`` FLOPs
    each); the fastest timing wins, since the peak is what the hardware *can* do. Uses torch's
    current thread count, so set it first.
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    # Warm-up, half a second of products: the thread pool and kernel choice, and on AMX CPUs
    # the first products of a process ran at a third to half of the rate that follows.
    warm_until = time.perf_counter() + 0.5
    while time.perf_counter() < warm_until:
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            torch.matmul(a, b)
        best = min(best, time.perf_counter() - started)
    return 2.0 * size**3 * calls / best / 1e9


def main() -> None:
    """Measure the matmul peaks and record them as this machine's ``flops`` result."""
    import argparse
    import os

    from results import add_arguments, measure_peaks, record

    parser = argparse.ArgumentParser(description="The CPU's float32 and bfloat16 matmul peaks.")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peaks = measure_peaks(smoke=args.smoke)
    for name, gflops in peaks.items():
        print(f"{name} matmul peak: {gflops:.1f} GFLOP/s ({args.threads} threads)")
    headline = {f"{name} GFLOP/s": gflops for name, gflops in peaks.items()}
    record("flops", args, {"threads": args.threads, "peaks": peaks}, headline, peaks)


if __name__ == "__main__":
    main()
