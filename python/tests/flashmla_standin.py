"""A stand-in for the `flash_mla` package (sgl-flash-mla, CUDA kernels only: it cannot run here) that SGLang 0.5.23's
kernels/ops/attention/flash_mla_interface.py imports, following FlashMLA's documented sparse FP8 decode
(README "Sparse MLA Decoding"; tests/ref.py ref_sparse_attn_decode; tests/quant.py for the V32 entry):

- q [b, s_q, h_q, 576], k_cache [blocks, 64, 1, 656] in the V32 FP8 layout: 512 FP8 e4m3 latent values, 4 float32
  scales (one per 128 values, multiplied in), 64 bf16 RoPE values; the key is the 576 dequantized values, the value
  their first 512;
- indices [b, s_q, topk] into the cache's token rows, -1 invalid;
- returns out [b, s_q, h_q, 512] bf16 and the natural-log LSE [b, h_q, s_q] float32; a query row with no valid
  index gets out 0 and LSE +inf.

Every call is logged (indices and the bytes of the rows they name), so a test can check which rows each
attention read and when."""
from __future__ import annotations

import dataclasses
import types

import torch

ENTRY, NOPE, SCALES, ROPE = 656, 512, 4, 64


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """[..., 656] uint8 V32 entries -> [..., 576] float32 keys."""
    nope = rows[..., :NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[..., NOPE:NOPE + 4 * SCALES].contiguous().view(torch.float32)
    rope = rows[..., NOPE + 4 * SCALES:].contiguous().view(torch.bfloat16).float()
    nope = nope * scales.repeat_interleave(NOPE // SCALES, dim=-1)
    return torch.cat([nope, rope], dim=-1)


def quantize(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """[n, 512] and [n, 64] float -> [n, 656] uint8 V32 entries (FlashMLA tests/quant.py: power-of-two scales)."""
    n = latent.shape[0]
    out = torch.empty((n, ENTRY), dtype=torch.uint8)
    tiles = latent.view(n, SCALES, NOPE // SCALES)
    scale = torch.pow(2, torch.clamp_min(tiles.abs().amax(dim=-1) / 448.0, 1e-4).log2().ceil()).float()
    out[:, :NOPE] = (tiles / scale.unsqueeze(-1)).reshape(n, NOPE).to(torch.float8_e4m3fn).view(torch.uint8)
    out[:, NOPE:NOPE + 4 * SCALES] = scale.contiguous().view(torch.uint8).view(n, 4 * SCALES)
    out[:, NOPE + 4 * SCALES:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8).view(n, 2 * ROPE)
    return out


def sparse_decode(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, sm_scale: float, dv: int):
    """q [b, s_q, h, 576]; rows [b, s_q, topk, 656] uint8; valid [b, s_q, topk] -> (out bf16 [b, s_q, h, dv],
    lse [b, h, s_q])."""
    keys = dequantize(rows)
    keys = torch.where(valid.unsqueeze(-1), keys, torch.zeros_like(keys))
    logits = torch.einsum("bshd,bskd->bshk", q.float(), keys) * sm_scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)                                   # [b, s_q, h]
    lonely = lse == float("-inf")
    p = torch.exp(logits - lse.masked_fill(lonely, 0.0).unsqueeze(-1)).masked_fill(lonely.unsqueeze(-1), 0.0)
    out = torch.einsum("bshk,bskd->bshd", p, keys[..., :dv])
    out = out.masked_fill(lonely.unsqueeze(-1), 0.0)
    lse = lse.masked_fill(lonely, float("inf"))
    return out.to(torch.bfloat16), lse.transpose(1, 2).contiguous()


@dataclasses.dataclass
class FlashMLASchedMeta:
    tile_scheduler_metadata: object = None
    num_splits: object = None


def module(log: list) -> types.ModuleType:
    """The `flash_mla` package as SGLang's interface module imports it; each decode call appended to `log` as
    (indices [b, s_q, topk] copy, rows [b, s_q, topk, 656] copy of the bytes read)."""
    m = types.ModuleType("flash_mla")

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                               extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                               extra_topk_length=None, use_legacy=True, kv_format=None, descale_q=None,
                               descale_k=None):
        assert indices is not None and is_fp8_kvcache and kv_format == "V32" and not causal
        assert attn_sink is None and extra_k_cache is None and topk_length is None
        assert isinstance(tile_scheduler_metadata, FlashMLASchedMeta)
        b, s_q, h, d = q.shape
        assert d == NOPE + ROPE and indices.shape[:2] == (b, s_q) and indices.dtype == torch.int32
        table = k_cache.view(torch.uint8).reshape(-1, ENTRY)
        valid = indices >= 0
        rows = table[indices.clamp_min(0).to(torch.int64)]
        log.append((indices.clone(), rows.clone()))
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        return sparse_decode(q, rows, valid, scale, head_dim_v)

    def unavailable(*args, **kwargs):
        raise AssertionError("not part of the stand-in: only the sparse FP8 decode is")

    m.flash_mla_with_kvcache = flash_mla_with_kvcache
    m.get_mla_metadata = lambda *a, **k: (FlashMLASchedMeta(), None)
    m.get_mla_decoding_metadata = unavailable
    m.flash_mla_sparse_fwd = unavailable
    m.fused_norm_rope_attn_rope_cast = unavailable
    m.flash_mla_interface = types.ModuleType("flash_mla.flash_mla_interface")
    m.flash_mla_interface.FlashMLASchedMeta = FlashMLASchedMeta
    return m


class DelayedCopy:
    """A DA copy's event on a host device, the copy delayed as far as stream order allows: the rows a swap fetched
    hold FP8 e4m3 NaN (poison) until a stream waits for the event, so any attention that reads them earlier is
    poisoned. The engine's tests poison each swap's fetched rows (poison) and put this in the copy event's place."""

    def __init__(self):
        self.saved, self.waits = [], 0

    def poison(self, rows: torch.Tensor, at: torch.Tensor) -> None:
        """rows[at] (a [rows, ...] uint8 view of the cache) poisoned until the next wait."""
        self.saved.append((rows, at, rows[at].clone()))
        rows[at] = 0x7F

    def wait(self, stream=None):
        self.waits += 1
        for rows, at, data in self.saved:
            rows[at] = data
        self.saved.clear()

    def record(self, stream=None):
        pass

