"""CausalLM: the Llama-family decoder (Llama, Qwen2, Qwen3) over a paged KV cache, in plain torch.

Module and parameter names mirror Hugging Face's (`model.layers.3.self_attn.q_proj.weight`),
with layer indices LOCAL to this pipeline stage; the loader maps them to global names and slices
them for this rank.

Pipeline stages: the first stage embeds token ids, the others take the previous stage's hidden
states [N, hidden_size]; the last stage applies the final norm and lm_head and returns float32
logits [S, vocab] at `batch.logits_indices`, the others return hidden states [N, hidden_size].

Two paths compute the same function. The reference path (the default, used on CPU and by the
oracle tests) is the plain module graph above. `use_ops(ops)` switches to the fused path: q/k/v
and gate/up run as one GEMM each, and the residual adds, norms, SiLU-and-mul, RoPE + KV write and
decode attention go through `ops` (`TorchOps` anywhere, `TritonOps` on CUDA), which on CUDA is
a handful of kernels per layer and can be captured in a CUDA graph; there every step attends in
one paged attention launch, and `warm_up` compiles the kernels' variants before serving.
"""

from __future__ import annotations

import torch
from torch import nn

from trtdisagg.kv.cache import KVCache
from trtdisagg.model.args import ModelArgs
from trtdisagg.model.attention import Attention, causal_mask
from trtdisagg.model.batch import AttentionMeta, ForwardBatch
from trtdisagg.model.gemm_plan import WeightGemms
from trtdisagg.model.layers import MLP, Embedding, Linear, RMSNorm
from trtdisagg.model.ops import TorchOps
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.rope import cos_sin, inv_frequencies


class DecoderLayer(nn.Module):
    def __init__(
        self, args: ModelArgs, *, parallel: Parallel, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps=eps, dtype=dtype, device=device)
        self.self_attn = Attention(args, parallel=parallel, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(h, eps=eps, dtype=dtype, device=device)
        self.mlp = MLP(
            args.hidden_size, args.intermediate_size, parallel=parallel, dtype=dtype, device=device
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: tuple[torch.Tensor | None, ...],
        batch: ForwardBatch,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + self.self_attn(
            h, cos=cos, sin=sin, masks=masks, batch=batch, cache=cache, layer=layer
        )
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        *,
        ops: TorchOps,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: tuple[torch.Tensor | None, ...],
        batch: ForwardBatch,
        cache: KVCache,
        layer: int,
        attention: AttentionMeta | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused path: (x, residual) -> (mlp output, residual stream before it).

        The residual stream is `x + residual`, added inside the next norm; `residual` is None
        for the first layer of a stage, whose `x` is the stream itself.
        """
        norm = self.input_layernorm
        if residual is None:
            h, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        attended = self.self_attn.forward_fused(
            h,
            ops=ops,
            cos=cos,
            sin=sin,
            masks=masks,
            attention=attention,
            batch=batch,
            cache=cache,
            layer=layer,
        )
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(attended, residual, norm.weight, norm.eps)
        return self.mlp.forward_fused(h, ops), residual


class _Body(nn.Module):
    """HF's `model.` prefix: embeddings, local layers, final norm (each only where present)."""

    def __init__(
        self, args: ModelArgs, *, parallel: Parallel, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        start, end = parallel.layer_range(args.num_layers)
        self.embed_tokens: Embedding | None = None
        self.norm: RMSNorm | None = None
        if parallel.is_first_stage:
            self.embed_tokens = Embedding(
                args.vocab_size, args.hidden_size, dtype=dtype, device=device
            )
        self.layers = nn.ModuleList(
            DecoderLayer(args, parallel=parallel, dtype=dtype, device=device)
            for _ in range(start, end)
        )
        if parallel.is_last_stage:
            self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps, dtype=dtype, device=device)


class CausalLM(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        *,
        parallel: Parallel | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        parallel = parallel or Parallel()
        device = device or torch.device("cpu")
        self.args = args
        self.parallel = parallel
        self.dtype = dtype
        self.device = device
        start, end = parallel.layer_range(args.num_layers)
        self.local_layer_ids: tuple[int, ...] = tuple(range(start, end))
        kv_start, kv_end = parallel.kv_head_range(args.num_kv_heads)
        self.local_kv_head_ids: tuple[int, ...] = tuple(range(kv_start, kv_end))
        self.model = _Body(args, parallel=parallel, dtype=dtype, device=device)
        self.lm_head: Linear | None = None
        if parallel.is_last_stage:
            self.lm_head = Linear(
                args.hidden_size, args.vocab_size, bias=False, dtype=dtype, device=device
            )
            if args.tie_word_embeddings and self.model.embed_tokens is not None:
                # One stage holds both ends: share the tensor, as HF does.
                self.lm_head.weight = self.model.embed_tokens.weight
        # Not a buffer: derived from args, and the loader must not look for it in checkpoints.
        self._inv_freq = inv_frequencies(
            args.head_dim, args.rope_theta, args.rope_scaling, device=device
        )
        # The fused path's operations; None runs the reference path.
        self.ops: TorchOps | None = None

    def use_ops(self, ops: TorchOps | None) -> None:
        """Run the fused path through `ops` (None: back to the reference path).

        The first call fuses the q/k/v and gate/up weights into one tensor each; the old
        parameters become views of them, so both paths keep working on the same weights.
        Call it after loading the weights.
        """
        if ops is not None:
            for block in self.decoder_layers:
                block.self_attn.fuse()
                block.mlp.fuse()
        self.ops = ops

    def warm_up(self, cache: KVCache) -> None:
        """Compile every kernel variant the fused path can meet while serving (nothing on the
        reference path or the torch ops). Writes nothing into `cache`; call it before serving,
        after `use_ops`."""
        if self.ops is not None:
            self.ops.warm_up(self, cache)

    def weight_gemms(self) -> list[WeightGemms]:
        """This stage's weight GEMMs, each with every layer's weight, for
        `TorchOps.plan_gemms` (empty before `use_ops` fused them): the fused ops give the o and
        down projections' inputs spare rows."""
        layers = self.decoder_layers
        qkv = tuple(w for b in layers if (w := b.self_attn.qkv_weight) is not None)
        gate_up = tuple(w for b in layers if (w := b.mlp.gate_up_weight) is not None)
        if not layers or len(qkv) < len(layers) or len(gate_up) < len(layers):
            return []
        gemms = [
            WeightGemms("qkv", qkv, spare_input=False),
            WeightGemms(
                "o_proj", tuple(b.self_attn.o_proj.weight for b in layers), spare_input=True
            ),
            WeightGemms("gate_up", gate_up, spare_input=False),
            WeightGemms(
                "down_proj", tuple(b.mlp.down_proj.weight for b in layers), spare_input=True
            ),
        ]
        if self.lm_head is not None:
            gemms.append(WeightGemms("lm_head", (self.lm_head.weight,), spare_input=False))
        return gemms

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """This stage's layers, typed."""
        return [block for block in self.model.layers if isinstance(block, DecoderLayer)]

    @property
    def local_num_kv_heads(self) -> int:
        return len(self.local_kv_head_ids)

    @property
    def local_num_layers(self) -> int:
        return len(self.local_layer_ids)

    def forward(
        self,
        batch: ForwardBatch,
        cache: KVCache,
        hidden: torch.Tensor | None = None,
        *,
        logits: bool = True,
        ops: TorchOps | None = None,
    ) -> torch.Tensor:
        """Run this stage's layers over the batch's new tokens.

        Args:
            batch: the step's tokens and attention metadata.
            cache: this rank's KV pool (its local layers, local kv heads).
            hidden: [N, hidden_size] from the previous stage; None on the first stage.
            logits: False stops the last stage before the output head: it returns the final
                norm's output at `batch.logits_indices` [S, hidden_size] (for `head`).
            ops: the fused path's operations for this call, in place of `use_ops`'s (the
                compiled decode step's `TracedOps`); the model must be fused already.

        Returns:
            Last stage: float32 logits [S, vocab]; other stages: hidden states [N, hidden_size].
        """
        if self.model.embed_tokens is not None:
            if hidden is not None:
                raise ValueError(
                    "the first pipeline stage embeds tokens; it takes no hidden states"
                )
            x = self.model.embed_tokens(batch.input_ids)
        else:
            if hidden is None:
                raise ValueError(f"pipeline stage {self.parallel.pp_rank} needs hidden states")
            x = hidden
        cos, sin = cos_sin(self._inv_freq, batch.positions, x.dtype)
        ops = self.ops if ops is None else ops
        # Built once for all layers: the step's metadata for the paged attention kernel.
        attention = None if ops is None else ops.prepare_attention(batch)
        # A decode batch attends batched, with no masks (and may carry no seqs); the paged
        # attention kernel needs none either.
        masks: tuple[torch.Tensor | None, ...] = ()
        if batch.decode is None and attention is None:
            masks = tuple(causal_mask(seq, x.device) for seq in batch.seqs)
        if ops is not None:
            last = self._forward_fused(
                x,
                ops,
                cos=cos,
                sin=sin,
                masks=masks,
                attention=attention,
                batch=batch,
                cache=cache,
            )
            return self.head(last) if logits and self.lm_head is not None else last
        for layer, block in enumerate(self.model.layers):
            x = block(x, cos=cos, sin=sin, masks=masks, batch=batch, cache=cache, layer=layer)
        if self.lm_head is None or self.model.norm is None:
            return x
        # The norm is per token, so taking the wanted rows first saves work and changes nothing.
        # In a decode batch every token is its sequence's last.
        last = self.model.norm(x if batch.decode is not None else x[batch.logits_indices])
        return self.head(last) if logits else last

    def head(self, last: torch.Tensor) -> torch.Tensor:
        """The output head: the final norm's output [S, hidden_size] -> float32 logits."""
        assert self.lm_head is not None, "only the last pipeline stage has the output head"
        if self.ops is None:
            return self.lm_head(last).float()
        return self.ops.linear(last, self.lm_head.weight).float()

    def _forward_fused(
        self,
        x: torch.Tensor,
        ops: TorchOps,
        *,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: tuple[torch.Tensor | None, ...],
        attention: AttentionMeta | None,
        batch: ForwardBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        residual: torch.Tensor | None = None
        for layer, block in enumerate(self.decoder_layers):
            x, residual = block.forward_fused(
                x,
                residual,
                ops=ops,
                cos=cos,
                sin=sin,
                masks=masks,
                batch=batch,
                cache=cache,
                layer=layer,
                attention=attention,
            )
        norm = self.model.norm
        if self.lm_head is None or norm is None:
            return x if residual is None else residual + x
        if residual is None:  # a last stage without layers
            return ops.rms_norm(
                x if batch.decode is not None else x[batch.logits_indices], norm.weight, norm.eps
            )
        if batch.decode is not None:
            return ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]
        rows = batch.logits_indices
        return ops.add_rms_norm(x[rows], residual[rows], norm.weight, norm.eps)[0]
