"""The correctness oracle (DESIGN.md §10): Hugging Face transformers, float32 on CPU.

* `make_hf_checkpoint` builds a random checkpoint with transformers itself, so the loader is
  tested against files we did not write.
* `hf_greedy` runs transformers greedily and records each step's top-2 logit margin.
* `assert_greedy_match` compares token for token, allowing a stop only at a reference near-tie.
* `PagedGreedy` drives our CausalLM over a paged KVCache the way the runner does (block ids,
  slot mapping, chunked prefill, several sequences per batch), for tests that check the model;
  with `batched_decode`, decode-only steps carry `DecodeMeta` (batched attention).
"""

from __future__ import annotations

import functools
import math
import shutil
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from trtdisagg.kv.cache import KVCache
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.batch import DecodeMeta, ForwardBatch, SeqSlice
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.tiny_tokenizer import BOS, EOS, PAD, special_token_id, write_tokenizer_files

NEAR_TIE = 1e-3


def make_hf_checkpoint(
    out_dir: Path,
    arch: str,
    *,
    vocab_size: int = 384,
    hidden_size: int = 64,
    intermediate_size: int = 160,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    rope_llama3: bool = False,
    max_shard_size: str | None = None,
    initializer_range: float = 0.2,
    seed: int = 0,
) -> Path:
    """A random checkpoint written by `XForCausalLM(config).save_pretrained`, plus the tiny
    tokenizer files. `arch` is llama | qwen2 | qwen3. Biases and norm weights are perturbed
    (transformers initialises them to 0 and 1), so loading them wrongly changes the tokens."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    extra: dict[str, Any] = {}
    if head_dim is not None:
        extra["head_dim"] = head_dim
    if rope_llama3:
        extra["rope_scaling"] = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=special_token_id(BOS),
        eos_token_id=special_token_id(EOS),
        pad_token_id=special_token_id(PAD),
        **extra,
    )
    torch.manual_seed(seed)
    model = model_class(config).float()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if name.endswith("norm.weight") else 0.0
                param.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    write_tokenizer_files(out_dir, vocab_size)
    return out_dir


@functools.lru_cache(maxsize=8)
def _hf_model(model_dir: str) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_greedy(
    model_dir: Path,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_ids: Collection[int] = (),
) -> tuple[list[int], list[float]]:
    """Greedy tokens from transformers (float32, CPU) and each step's top-2 logit margin.

    Recomputes the whole sequence each step instead of using transformers' KV cache, whose
    API keeps changing between versions; stops after an eos token when `eos_token_ids` is given.
    """
    model = _hf_model(str(model_dir))
    ids = list(prompt_ids)
    tokens: list[int] = []
    margins: list[float] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(logits, 2)
            token = int(top.indices[0])
            tokens.append(token)
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(token)
            if token in eos_token_ids:
                break
    return tokens, margins


def assert_greedy_match(
    ours: Sequence[int],
    ref_tokens: Sequence[int],
    ref_margins: Sequence[float],
    tol: float = NEAR_TIE,
) -> int:
    """Assert `ours` equals the reference token for token (DESIGN.md §10).

    The comparison may stop early only at a step whose reference top-2 margin is below `tol`
    (a near-tie, where float summation order can legitimately flip the argmax); a difference
    anywhere else, including a different length, fails with both sequences in the message.

    Returns:
        How many tokens were compared.
    """
    for step, (mine, ref) in enumerate(zip(ours, ref_tokens)):
        if mine != ref:
            if ref_margins[step] < tol:
                return step
            raise AssertionError(
                f"greedy mismatch at step {step} (reference margin {ref_margins[step]:.4g}):\n"
                f"  ours: {list(ours)}\n  ref:  {list(ref_tokens)}"
            )
    if len(ours) != len(ref_tokens):
        raise AssertionError(
            f"greedy length differs: ours {len(ours)}, ref {len(ref_tokens)}:\n"
            f"  ours: {list(ours)}\n  ref:  {list(ref_tokens)}"
        )
    return len(ours)


@attrs.define(eq=False, kw_only=True)
class Seq:
    tokens: list[int]
    num_cached: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = attrs.field(factory=list)


@attrs.define(eq=False, kw_only=True)
class PagedGreedy:
    """Our side of the oracle: greedy decoding over a paged cache with a trivial block allocator.

    `stages` are (model, cache) per pipeline stage of one TP rank, run in order in this process.
    """

    stages: list[tuple[CausalLM, KVCache]]
    next_block: int = 0
    batched_decode: bool = False  # decode-only steps attend batched (DecodeMeta)
    # Top-2 logit margin of each sequence at the last step, and the step's float32 logits.
    last_margins: list[float] = attrs.field(factory=list)
    last_logits: torch.Tensor | None = None

    @classmethod
    def single(
        cls,
        model: CausalLM,
        *,
        layout: Layout = Layout.HND,
        tokens_per_block: int = 4,
        num_blocks: int = 256,
        batched_decode: bool = False,
    ) -> PagedGreedy:
        cache = make_cache(model, layout, tokens_per_block, num_blocks)
        return cls(stages=[(model, cache)], batched_decode=batched_decode)

    @property
    def tokens_per_block(self) -> int:
        return self.stages[0][1].tokens_per_block

    def allocate(self, seq: Seq, upto: int) -> None:
        needed = math.ceil(upto / self.tokens_per_block)
        while len(seq.block_ids) < needed:
            seq.block_ids.append(self.next_block)
            self.next_block += 1

    def step(self, work: Sequence[tuple[Seq, int]]) -> list[int]:
        """One forward over `(seq, n)` pairs: each computes its next n uncached tokens.
        Returns the argmax after each sequence's last new token."""
        tpb = self.tokens_per_block
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        slices: list[SeqSlice] = []
        last: list[int] = []
        device = self.stages[0][0].device
        for seq, n in work:
            start, end = seq.num_cached, seq.num_cached + n
            assert end <= len(seq.tokens)
            self.allocate(seq, end)
            slices.append(
                SeqSlice(
                    q_start=len(ids),
                    q_len=n,
                    kv_len=end,
                    block_ids=torch.tensor(seq.block_ids[: math.ceil(end / tpb)], device=device),
                )
            )
            ids.extend(seq.tokens[start:end])
            positions.extend(range(start, end))
            slots.extend(seq.block_ids[p // tpb] * tpb + p % tpb for p in range(start, end))
            last.append(len(ids) - 1)
            seq.num_cached = end
        decode: DecodeMeta | None = None
        if self.batched_decode and all(n == 1 for _, n in work):
            width = max(len(seq.block_ids) for seq, _ in work)
            # Padded with block 0, as any valid id will do: padding is never attended.
            table = [seq.block_ids + [0] * (width - len(seq.block_ids)) for seq, _ in work]
            lens = [s.kv_len for s in slices]
            decode = DecodeMeta(
                block_table=torch.tensor(table, dtype=torch.int32, device=device),
                context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                max_context_len=max(lens),
            )
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, device=device),
            positions=torch.tensor(positions, device=device),
            slot_mapping=torch.tensor(slots, device=device),
            seqs=tuple(slices),
            logits_indices=torch.tensor(last, device=device),
            decode=decode,
        )
        hidden: torch.Tensor | None = None
        with torch.inference_mode():
            for model, cache in self.stages:
                hidden = model(batch, cache, hidden)
        assert hidden is not None
        self.last_logits = hidden.float().clone()
        top = torch.topk(self.last_logits, 2, dim=-1).values
        self.last_margins = [float(m) for m in (top[:, 0] - top[:, 1]).tolist()]
        return [int(t) for t in hidden.argmax(dim=-1).tolist()]

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        chunks: Sequence[int] = (),
        seq: Seq | None = None,
        margins: list[float] | None = None,
    ) -> list[int]:
        """Greedy tokens for `prompt`; the prefill is split as `chunks` (the rest in one go).
        Each output token's top-2 logit margin is appended to `margins` if given."""
        seq = seq or Seq(tokens=list(prompt))
        out: list[int] = []
        rest = len(seq.tokens) - seq.num_cached - sum(chunks)
        assert rest > 0, "the last prompt token must be computed to get its logits"
        for n in [*chunks, rest]:
            (token,) = self.step([(seq, n)])
        for _ in range(max_new_tokens):
            out.append(token)
            if margins is not None:
                margins.append(self.last_margins[0])
            seq.tokens.append(token)
            if len(out) == max_new_tokens:
                break
            (token,) = self.step([(seq, 1)])
        return out


def make_cache(model: CausalLM, layout: Layout, tokens_per_block: int, num_blocks: int) -> KVCache:
    return KVCache(
        num_blocks=num_blocks,
        num_layers=model.local_num_layers,
        num_kv_heads=model.local_num_kv_heads,
        head_dim=model.args.head_dim,
        tokens_per_block=tokens_per_block,
        layout=layout,
        dtype=model.dtype,
        device=model.device,
    )


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
