# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fidelity of DSA's quantized indexer and fp8_ds_mla cache.

The byte formats are exact against their references; this measures what they
change in what one Kimi K3.1 DSA layer selects and computes, for decode
queries that each see a whole context of ``N`` tokens:

- **recall** ``|S_quant & S_fp32| / k`` of the top-k set selected from the
  quantized indexer against fp32 scoring of the same keys and queries. The
  quantized score is ``sum_h w_h relu(q_h . k)`` computed in fp32 on the
  values the reader decodes from our bytes (the query as served too): what
  DeepGEMM's MQA logits compute up to accumulation order. Variants:
  ``fp8-sm90`` (fp32 scale word, fp32 weights and logits), ``fp8-ue8m0``
  (the SM100 reader: UE8M0 scale bytes, bf16 weights, bf16 logits),
  ``mxfp4`` (MXFP4 keys and query, bf16 weights and logits); diagnostics:
  ``bf16`` (keys kept in bf16, no quantization: the floor any cache starts
  from), ``fp8-k-only`` and ``mxfp4-k-only`` (quantized keys, the bf16
  query, fp32 logits: the keys' share of the loss).
  Ties at the k-th score (bf16 logits have many) count with the probability
  that an arbitrary tie-break keeps the key, so recall is the expected
  overlap.
- **layer output**: absorbed-form sparse MLA over the selected tokens
  (``softmax((q_latent . c_s + q_pe . pe_s) / sqrt(192)) @ c_s``, every MLA
  head, fp32 arithmetic), relative error ``|O - O_ref| / |O_ref|`` per query
  against the fp32 latent with the exact (fp32) selection, for: the
  ``fp8_ds_mla`` cache alone (exact selection), the quantized selection alone
  (fp32 latent), and both together (what is served).
- **quantization input**: each cache quantized from the bf16-rounded normed
  values (ours: the k-norm and the latent RMSNorm return bf16, as upstream's
  unfused insert) and from the fp32 normed values (vLLM's Triton DeepSeek
  V3.2 prologue), with paired per-query differences.

The bytes come from the package's own references (``formats.py`` and
``reference.py``: ``write_indexer_entries``, ``k_norm``, ``rms_norm``,
``indexer_q_quant``) and are read back through the cache layout
(``indexer_block_views``) and decoders written from the byte formats; a check
per case compares them with ``reference.fused_prologue``.
Inputs: see ``recipes.py`` (structured, gaussian, the tiny checkpoint).

    python benchmarks/fidelity/bench_fidelity.py --json fidelity.json

Runs on CUDA when present, else on the CPU (``--device``); all arithmetic is
torch, so the numbers do not depend on SM10x-only kernels.
"""

import argparse
import datetime
import json
import math
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
for path in (HERE, REPO_ROOT):
    if str(path) not in sys.path:
        # Run from a checkout without installing (the GPU machine has no vLLM).
        sys.path.insert(0, str(path))

from recipes import (  # noqa: E402
    INDEX_HEAD_DIM,
    INDEX_HEADS,
    LOGIT_STD,
    MLA_SOFTMAX_SCALE,
    RECIPES,
    LayerInputs,
    layer_norm_fp32,
    make_inputs,
    rms_norm_fp32,
    write_tiny_checkpoint_dir,
)

from vllm.models.kimi_k3.common import dsa_formats  # noqa: E402
from vllm.models.kimi_k3.nvidia.dsa_ops import formats, reference  # noqa: E402
from vllm.models.kimi_k3.nvidia.dsa_ops.sparse_mla import (  # noqa: E402
    dequantize_entries,
)

# KimiK3DSAIndexer: weight_scale = index_head_dim**-0.5 * index_num_heads**-0.5.
INDEX_WEIGHT_SCALE = INDEX_HEAD_DIM**-0.5 * INDEX_HEADS**-0.5
CACHE_BLOCK = 64
# Keys scored per step (bounds the [queries, heads, chunk] intermediate).
SCORE_CHUNK = 8192
# Served variants, after three diagnostics that isolate one effect each: keys
# kept in bf16 (no quantization), fp8 or MXFP4 keys with the bf16 query.
VARIANTS = (
    "bf16",
    "fp8-k-only",
    "mxfp4-k-only",
    "fp8-sm90",
    "fp8-ue8m0",
    "mxfp4",
)
# Where the normed values are quantized from: ours (bf16-rounded) or fp32.
SOURCES = ("bf16", "fp32")
RECALL_TARGETS = {"fp8-sm90": 0.99, "fp8-ue8m0": 0.99, "mxfp4": 0.97}
LAYER_ERROR_FACTOR = 2.0
# "Measurably better": a paired mean improvement above this many standard
# errors and above the practical floor below.
SIGNIFICANCE_SE = 3.0
RECALL_FLOOR = 1e-3
ERROR_FLOOR = 0.01  # relative to ours


# ---------------------------------------------------------------------------
# Decoders of the cache bytes (written from the formats, not the encoders).
# ---------------------------------------------------------------------------


def decode_indexer_entries(
    values: torch.Tensor, scales: torch.Tensor, fp4: bool, mx_scales: bool
) -> torch.Tensor:
    """fp32 keys ``[N, 128]`` that a reader decodes from indexer entries."""
    if fp4:
        return formats.mxfp4_dequantize_rows(values, scales)
    if mx_scales:
        # Four equal UE8M0 bytes: the biased exponent of the row's scale.
        if not torch.equal(scales, scales[:, :1].expand_as(scales)):
            raise AssertionError("UE8M0 scale word with unequal bytes")
        scale = formats.exp2_int(scales[:, 0].to(torch.int32) - dsa_formats.UE8M0_BIAS)
    else:
        scale = scales.contiguous().view(torch.float32).squeeze(-1)
    return formats.fp8_e4m3_decode(values) * scale[:, None]


@dataclass
class IndexerCache:
    """Value and scale bytes of ``N`` tokens read back from a paged cache."""

    values: torch.Tensor
    scales: torch.Tensor
    fp4: bool
    mx_scales: bool

    def decode(self) -> torch.Tensor:
        return decode_indexer_entries(
            self.values, self.scales, self.fp4, self.mx_scales
        )


def indexer_cache(k: torch.Tensor, fp4: bool, mx_scales: bool) -> IndexerCache:
    """Write normed keys ``k`` (used as given: bf16 or fp32) into a paged
    indexer cache at slots ``0..N-1`` and read the bytes back."""
    n, head_dim = k.shape
    num_blocks = -(-n // CACHE_BLOCK)
    entry = dsa_formats.indexer_entry_bytes(head_dim, fp4)
    cache = torch.zeros(
        num_blocks, CACHE_BLOCK, entry, dtype=torch.uint8, device=k.device
    )
    slots = torch.arange(n, device=k.device)
    reference.write_indexer_entries(k, slots, cache, fp4=fp4, mx_scales=mx_scales)
    values, scales = formats.indexer_block_views(cache, head_dim, fp4)
    return IndexerCache(
        values.reshape(-1, values.shape[-1])[:n],
        scales.reshape(-1, scales.shape[-1])[:n],
        fp4,
        mx_scales,
    )


def check_prologue_bytes(inputs: LayerInputs, tokens: int = 256) -> None:
    """Our composition of the references (the bf16 source) writes the bytes
    of ``reference.fused_prologue``, the contract of the fused kernels."""
    n = min(tokens, inputs.index_k.shape[0])
    dev = inputs.index_k.device
    k = reference.k_norm(
        inputs.index_k[:n], inputs.k_norm_weight, inputs.k_norm_bias, inputs.eps
    )
    latent = reference.rms_norm(inputs.kv_c[:n], inputs.kv_norm_weight, inputs.eps)
    expect_mla = formats.fp8_ds_mla_entry(latent, inputs.k_pe[:n])
    num_blocks = -(-n // CACHE_BLOCK)
    slots = torch.arange(n, device=dev)
    # The query half of the prologue is not measured here: a narrow dummy.
    q_c = torch.zeros(n, 64, dtype=torch.bfloat16, device=dev)
    q_w = torch.ones(64, device=dev)
    for fp4, mx in ((False, False), (False, True), (True, False)):
        entry = dsa_formats.indexer_entry_bytes(INDEX_HEAD_DIM, fp4)
        index_cache = torch.zeros(
            num_blocks, CACHE_BLOCK, entry, dtype=torch.uint8, device=dev
        )
        mla_cache = torch.zeros(
            num_blocks,
            CACHE_BLOCK,
            dsa_formats.DS_MLA_ENTRY_BYTES,
            dtype=torch.uint8,
            device=dev,
        )
        topk = torch.empty(n, 8, dtype=torch.int32, device=dev)
        reference.fused_prologue(
            q_c,
            inputs.kv_c[:n],
            inputs.k_pe[:n],
            inputs.index_k[:n],
            q_w,
            inputs.kv_norm_weight,
            inputs.k_norm_weight,
            inputs.k_norm_bias,
            inputs.eps,
            topk,
            mla_cache,
            slots,
            index_cache,
            slots,
            fp4=fp4,
            mx_scales=mx,
        )
        ours = indexer_cache(k, fp4, mx)
        got = IndexerCache(
            *(
                v.reshape(-1, v.shape[-1])[:n]
                for v in formats.indexer_block_views(index_cache, INDEX_HEAD_DIM, fp4)
            ),
            fp4,
            mx,
        )
        same = torch.equal(ours.values, got.values) and torch.equal(
            ours.scales, got.scales
        )
        mla_bytes = mla_cache.view(-1, dsa_formats.DS_MLA_ENTRY_BYTES)[:n]
        same = same and torch.equal(mla_bytes, expect_mla)
        if not same:
            raise AssertionError(
                f"reference.fused_prologue bytes differ (fp4={fp4}, mx_scales={mx})"
            )


# ---------------------------------------------------------------------------
# Indexer scoring and selection.
# ---------------------------------------------------------------------------


def index_scores(
    q: torch.Tensor, weight_sets: list[torch.Tensor], k: torch.Tensor
) -> list[torch.Tensor]:
    """``sum_h w[t, h] relu(q[t, h] . k[s])`` in fp32 for each weight set
    (``q [Q, H, D]``, weights ``[Q, H]``, ``k [N, D]``) -> ``[Q, N]`` each;
    the relu products are shared by the weight sets."""
    nq, heads, dim = q.shape
    n = k.shape[0]
    flat = q.reshape(nq * heads, dim)
    outs = [q.new_empty(nq, n) for _ in weight_sets]
    for start in range(0, n, SCORE_CHUNK):
        end = min(n, start + SCORE_CHUNK)
        r = torch.relu(flat @ k[start:end].T).view(nq, heads, end - start)
        for out, w in zip(outs, weight_sets, strict=True):
            out[:, start:end] = torch.bmm(w.unsqueeze(1), r).squeeze(1)
    return outs


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to bf16 (SM100 weights and logits)."""
    return x.bfloat16().float()


@dataclass
class Selection:
    """A top-k selection per query: ``prob [Q, N]`` is the probability that a
    key is kept under an arbitrary tie-break at the k-th score; ``index
    [Q, k]`` one concrete set (ties at the boundary: lowest positions
    first); ``ties`` the size of the tie group at the k-th score."""

    prob: torch.Tensor
    index: torch.Tensor
    ties: torch.Tensor


def select(scores: torch.Tensor, k: int) -> Selection:
    """Top-k of ``scores [Q, N]`` with the ties at the k-th score made
    explicit (bf16 logits tie often; ``torch.topk`` would pick silently)."""
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    n_above = above.sum(-1, keepdim=True)
    n_tied = tied.sum(-1, keepdim=True)
    need = k - n_above
    prob = above.float() + tied.float() * (need.float() / n_tied.float())
    chosen = above | (tied & (tied.cumsum(-1) <= need))
    index = chosen.nonzero()[:, 1].view(scores.shape[0], k)
    return Selection(prob, index, n_tied.squeeze(-1).float())


def recall_stats(
    sel: Selection, ref: Selection, scores: torch.Tensor, ref_scores: torch.Tensor
) -> dict[str, Any]:
    """Expected overlap with the fp32 set, plus why it misses: the deepest
    fp32 rank a selectable key has, the score noise relative to the spread
    of the scores, and the tie group at the boundary."""
    k = ref.index.shape[1]
    recall = (sel.prob * ref.prob).sum(-1) / k
    floor = torch.where(sel.prob > 0, ref_scores, torch.inf).amin(-1, keepdim=True)
    deepest = (ref_scores > floor).sum(-1) + 1
    noise = (scores - ref_scores).pow(2).mean(-1).sqrt() / ref_scores.std(-1)
    return {
        "recall_mean": recall.mean().item(),
        "recall_min": recall.min().item(),
        "recall_per_query": recall.tolist(),
        "deepest_rank": int(deepest.max().item()),
        "score_noise": noise.mean().item(),
        "boundary_ties": sel.ties.mean().item(),
    }


# ---------------------------------------------------------------------------
# Sparse MLA in the absorbed form.
# ---------------------------------------------------------------------------


def sparse_mla(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    pe: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """``softmax((q_latent . c_s + q_pe . pe_s) * scale) @ c_s`` over the
    selected tokens, every head, fp32 -> ``[Q, H, 512]``."""
    lat = latent[index]  # [Q, k, 512]
    rope = pe[index]
    logits = torch.bmm(q_latent, lat.transpose(1, 2))
    logits += torch.bmm(q_pe, rope.transpose(1, 2))
    probs = torch.softmax(logits * MLA_SOFTMAX_SCALE, dim=-1)
    return torch.bmm(probs, lat)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``|out - ref| / |ref|`` per query (Frobenius over heads and dims)."""
    return (out - ref).flatten(1).norm(dim=-1) / ref.flatten(1).norm(dim=-1)


def dense_mass(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    pe: torch.Tensor,
    selected: torch.Tensor,
) -> torch.Tensor:
    """Share of the dense (all-token) attention that falls on ``selected
    [Q, N]`` per query and head: how much the exact top-k captures."""
    nq, heads, _ = q_latent.shape
    n = latent.shape[0]
    lse_all = q_latent.new_full((nq, heads), -math.inf)
    lse_sel = lse_all.clone()
    ql, qp = q_latent.reshape(nq * heads, -1), q_pe.reshape(nq * heads, -1)
    for start in range(0, n, SCORE_CHUNK):
        end = min(n, start + SCORE_CHUNK)
        logits = ql @ latent[start:end].T + qp @ pe[start:end].T
        logits = (logits * MLA_SOFTMAX_SCALE).view(nq, heads, end - start)
        lse_all = torch.logaddexp(lse_all, torch.logsumexp(logits, -1))
        mask = ~selected[:, None, start:end]
        masked = logits.masked_fill(mask, -math.inf)
        lse_sel = torch.logaddexp(lse_sel, torch.logsumexp(masked, -1))
    return torch.exp(lse_sel - lse_all)


# ---------------------------------------------------------------------------
# One (recipe, context) case.
# ---------------------------------------------------------------------------


def _err_stats(err: torch.Tensor) -> dict[str, Any]:
    return {
        "mean": err.mean().item(),
        "max": err.max().item(),
        "per_query": err.tolist(),
    }


def _element_stats(
    truth: torch.Tensor,
    ours: torch.Tensor,
    alt: torch.Tensor,
    ours_bytes: torch.Tensor,
    alt_bytes: torch.Tensor,
) -> dict[str, float]:
    """How the two quantization inputs differ element by element: share of
    value bytes that differ, and each one's relative rms error to the fp32
    normed values."""
    norm = truth.norm().item()
    return {
        "bytes_differ": (ours_bytes != alt_bytes).float().mean().item(),
        "rel_rms_ours": (ours - truth).norm().item() / norm,
        "rel_rms_fp32": (alt - truth).norm().item() / norm,
    }


def run_case(
    recipe: str,
    context: int,
    args: argparse.Namespace,
    device: torch.device,
    tiny_dir: Path | None,
) -> dict[str, Any]:
    """Every figure of one (recipe, context) case, as a JSON-ready dict."""
    t0 = time.perf_counter()
    inputs = make_inputs(
        recipe,
        context,
        args.num_queries,
        args.seed,
        args.mla_heads,
        tiny_dir,
        args.logit_std,
    ).to(device)
    check_prologue_bytes(inputs)
    topk = min(args.topk, context)

    # Normed values: the truth (fp32) and the two quantization inputs.
    k_true = layer_norm_fp32(inputs)
    c_true = rms_norm_fp32(inputs)
    k_in = {
        "bf16": reference.k_norm(
            inputs.index_k, inputs.k_norm_weight, inputs.k_norm_bias, inputs.eps
        ),
        "fp32": k_true,
    }
    c_in = {
        "bf16": reference.rms_norm(inputs.kv_c, inputs.kv_norm_weight, inputs.eps),
        "fp32": c_true,
    }
    if not torch.equal(k_in["bf16"].float(), bf16_round(k_true)):
        raise AssertionError("reference.k_norm is not the rounded fp32 k-norm")
    if not torch.equal(c_in["bf16"].float(), bf16_round(c_true)):
        raise AssertionError("reference.rms_norm is not the rounded fp32 RMSNorm")

    # Queries as served: bf16 GEMM output -> fp8 (scale folded into the
    # weights) or MXFP4 (scales beside it).
    q_true = inputs.index_q.float()
    w_true = inputs.index_weights.float() * INDEX_WEIGHT_SCALE
    q8, _, w8 = reference.indexer_q_quant(
        inputs.index_q, inputs.index_weights, INDEX_WEIGHT_SCALE, INDEX_HEADS
    )
    q8 = q8.float()
    packed, q_scale, w4 = reference.indexer_q_quant(
        inputs.index_q, inputs.index_weights, INDEX_WEIGHT_SCALE, INDEX_HEADS, fp4=True
    )
    nq = packed.shape[0]
    q4 = formats.mxfp4_dequantize_rows(
        packed, q_scale.contiguous().view(torch.uint8).view(nq, INDEX_HEADS, -1)
    )

    (ref_scores,) = index_scores(q_true, [w_true], k_true)
    ref = select(ref_scores, topk)
    scores: dict[tuple[str, str], torch.Tensor] = {}
    (scores["bf16", "bf16"],) = index_scores(q_true, [w_true], k_in["bf16"].float())
    elements: dict[str, dict[str, float]] = {}
    caches: dict[str, dict[str, Any]] = {}
    for src in SOURCES:
        sm90 = indexer_cache(k_in[src], fp4=False, mx_scales=False)
        ue8m0 = indexer_cache(k_in[src], fp4=False, mx_scales=True)
        mx = indexer_cache(k_in[src], fp4=True, mx_scales=False)
        k8 = sm90.decode()
        if not torch.equal(k8, ue8m0.decode()):
            raise AssertionError("the SM90 and SM100 fp8 caches decode differently")
        s90, s100 = index_scores(q8, [w8, bf16_round(w8)], k8)
        scores["fp8-sm90", src] = s90
        scores["fp8-ue8m0", src] = bf16_round(s100)
        k4 = mx.decode()
        (s4,) = index_scores(q4, [bf16_round(w4)], k4)
        scores["mxfp4", src] = bf16_round(s4)
        entries = formats.fp8_ds_mla_entry(c_in[src], inputs.k_pe)
        latent, pe = dequantize_entries(entries)
        caches[src] = {
            "k8": k8,
            "k8_bytes": sm90.values,
            "k4": k4,
            "k4_bytes": mx.values,
            "latent": latent,
            "latent_bytes": entries[:, : dsa_formats.DS_MLA_NOPE_DIM],
            "pe": pe,
        }
    # Diagnostics: the keys' share of the loss (bf16 query, fp32 logits).
    for variant, key in (("fp8-k-only", "k8"), ("mxfp4-k-only", "k4")):
        (scores[variant, "bf16"],) = index_scores(q_true, [w_true], caches["bf16"][key])
    pe_true = inputs.k_pe.float()
    if not all(torch.equal(caches[s]["pe"], pe_true) for s in SOURCES):
        raise AssertionError("fp8_ds_mla rope values are not the bf16 input")
    for name, truth, key in (
        ("indexer_fp8", k_true, "k8"),
        ("indexer_mxfp4", k_true, "k4"),
        ("fp8_ds_mla", c_true, "latent"),
    ):
        elements[name] = _element_stats(
            truth,
            caches["bf16"][key],
            caches["fp32"][key],
            caches["bf16"][key + "_bytes"],
            caches["fp32"][key + "_bytes"],
        )

    # Layer output: reference, cache alone, selection alone, both.
    ql, qp = inputs.q_latent, inputs.q_pe
    out_ref = sparse_mla(ql, qp, c_true, pe_true, ref.index)
    in_ref = torch.zeros_like(ref.prob, dtype=torch.bool)
    in_ref.scatter_(1, ref.index, True)
    mass = dense_mass(ql, qp, c_true, pe_true, in_ref)
    cache_only = {
        src: _err_stats(
            relative_error(
                sparse_mla(ql, qp, caches[src]["latent"], pe_true, ref.index),
                out_ref,
            )
        )
        for src in SOURCES
    }
    out_bf16 = sparse_mla(ql, qp, c_in["bf16"].float(), pe_true, ref.index)
    bf16_cache = _err_stats(relative_error(out_bf16, out_ref))
    rows: list[dict[str, Any]] = []
    order = sorted(scores, key=lambda vs: (SOURCES.index(vs[1]), VARIANTS.index(vs[0])))
    for variant, src in order:
        s = scores[variant, src]
        sel = select(s, topk)
        row: dict[str, Any] = {"variant": variant, "source": src}
        row.update(recall_stats(sel, ref, s, ref_scores))
        row["selection_only"] = _err_stats(
            relative_error(sparse_mla(ql, qp, c_true, pe_true, sel.index), out_ref)
        )
        row["combined"] = _err_stats(
            relative_error(
                sparse_mla(ql, qp, caches[src]["latent"], pe_true, sel.index),
                out_ref,
            )
        )
        row["cache_only"] = cache_only[src]["mean"]
        row["error_ratio"] = row["combined"]["mean"] / cache_only[src]["mean"]
        # The tail: queries whose output moved more than twice the cache's
        # mean error (a heavily attended key lost at the boundary).
        limit = LAYER_ERROR_FACTOR * cache_only[src]["mean"]
        row["queries_over_limit"] = sum(e > limit for e in row["combined"]["per_query"])
        row["targets"] = check_targets(row)
        rows.append(row)
    return {
        "recipe": recipe,
        "context": context,
        "topk": topk,
        "num_queries": args.num_queries,
        "mla_heads": ql.shape[1],
        "seconds": time.perf_counter() - t0,
        "dense_mass_in_exact_topk": {
            "mean": mass.mean().item(),
            "min": mass.min().item(),
        },
        "elements": elements,
        "cache_only": cache_only,
        "bf16_cache": bf16_cache,
        "rows": rows,
        "source_comparison": compare_sources(rows, cache_only),
    }


def check_targets(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The fidelity targets of one row (docs/fidelity.md): recall (fp8 >=
    0.99, MXFP4 >= 0.97 on the mean over queries) and combined layer error
    <= 2x the cache alone."""
    checks = []
    target = RECALL_TARGETS.get(row["variant"])
    if target is not None:
        value = row["recall_mean"]
        checks.append(
            {
                "name": f"recall >= {target}",
                "value": value,
                "passed": value >= target,
                "miss_by": max(0.0, target - value),
            }
        )
        value = row["error_ratio"]
        checks.append(
            {
                "name": f"layer error <= {LAYER_ERROR_FACTOR:g}x cache alone",
                "value": value,
                "passed": value <= LAYER_ERROR_FACTOR,
                "miss_by": max(0.0, value - LAYER_ERROR_FACTOR),
            }
        )
    return checks


def _paired(better: list[float], worse: list[float]) -> tuple[float, float]:
    """Mean and standard error of the paired difference ``better - worse``."""
    d = torch.tensor(better, dtype=torch.float64)
    d -= torch.tensor(worse, dtype=torch.float64)
    se = d.std().item() / math.sqrt(d.numel()) if d.numel() > 1 else math.inf
    return d.mean().item(), se


def compare_sources(
    rows: list[dict[str, Any]], cache_only: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Does quantizing from the fp32 normed values measurably beat ours
    (bf16-rounded): the fp8_ds_mla cache alone (layer error, exact
    selection), and per variant in recall or in the combined layer error?"""
    by = {(r["variant"], r["source"]): r for r in rows}
    ours_err, alt_err = (cache_only[s]["per_query"] for s in SOURCES)
    d_err, se_err = _paired(ours_err, alt_err)
    rel_err = d_err / cache_only["bf16"]["mean"]
    out: dict[str, Any] = {
        "fp8_ds_mla": {
            "error_reduction": d_err,
            "error_reduction_se": se_err,
            "error_reduction_relative": rel_err,
            "fp32_measurably_better": d_err > SIGNIFICANCE_SE * se_err
            and rel_err > ERROR_FLOOR,
        }
    }
    for variant in VARIANTS:
        if (variant, "fp32") not in by:
            continue
        ours, alt = by[variant, "bf16"], by[variant, "fp32"]
        d_rec, se_rec = _paired(alt["recall_per_query"], ours["recall_per_query"])
        d_err, se_err = _paired(
            ours["combined"]["per_query"], alt["combined"]["per_query"]
        )
        rel_err = d_err / ours["combined"]["mean"]
        recall_better = d_rec > SIGNIFICANCE_SE * se_rec and d_rec > RECALL_FLOOR
        error_better = d_err > SIGNIFICANCE_SE * se_err and rel_err > ERROR_FLOOR
        out[variant] = {
            "recall_gain": d_rec,
            "recall_gain_se": se_rec,
            "error_reduction": d_err,
            "error_reduction_se": se_err,
            "error_reduction_relative": rel_err,
            "fp32_measurably_better": recall_better or error_better,
        }
    return out


# ---------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def format_case(case: dict[str, Any]) -> list[str]:
    mass = case["dense_mass_in_exact_topk"]
    lines = [
        "",
        f"== {case['recipe']}, context {_ctx(case['context'])}, top-k "
        f"{case['topk']}, {case['num_queries']} queries, {case['mla_heads']} "
        f"MLA heads ({case['seconds']:.1f} s)",
        f"   dense attention mass in the exact top-k: mean {mass['mean']:.3f}, "
        f"min {mass['min']:.3f}",
    ]
    for name, e in case["elements"].items():
        lines.append(
            f"   {name:<14} bytes differ bf16-vs-fp32 input {e['bytes_differ']:.2%}; "
            f"rel. rms error to fp32: ours {e['rel_rms_ours']:.5f}, "
            f"fp32 input {e['rel_rms_fp32']:.5f}"
        )
    lines.append(
        f"   layer error, exact selection: fp8_ds_mla cache "
        f"{case['cache_only']['bf16']['mean']:.5f} (fp32 input "
        f"{case['cache_only']['fp32']['mean']:.5f}), bf16 cache "
        f"{case['bf16_cache']['mean']:.5f}"
    )
    head = (
        f"   {'variant':<12} {'keys':<5} {'recall':>7} {'min':>7} {'deepest':>8} "
        f"{'noise':>7} {'ties':>5} | {'sel-only':>8} {'combined':>8} "
        f"{'max':>8} {'x cache':>7} {'>2x':>4} | targets"
    )
    lines += [head, "   " + "-" * (len(head) - 3)]
    for r in case["rows"]:
        marks = ", ".join(
            f"{t['name']}: {'ok' if t['passed'] else 'MISS'}" for t in r["targets"]
        )
        lines.append(
            f"   {r['variant']:<12} {r['source']:<5} {r['recall_mean']:>7.4f} "
            f"{r['recall_min']:>7.4f} {r['deepest_rank']:>8d} "
            f"{r['score_noise']:>7.4f} {r['boundary_ties']:>5.1f} | "
            f"{r['selection_only']['mean']:>8.5f} {r['combined']['mean']:>8.5f} "
            f"{r['combined']['max']:>8.5f} {r['error_ratio']:>7.2f} "
            f"{r['queries_over_limit']:>4d} | {marks or '-'}"
        )
    for variant, c in case["source_comparison"].items():
        verdict = "no measurable gain"
        if c["fp32_measurably_better"]:
            verdict = "fp32 input better"
        recall = ""
        if "recall_gain" in c:
            recall = f"recall {c['recall_gain']:+.5f} (se {c['recall_gain_se']:.5f}), "
        what = "cache-alone" if variant == "fp8_ds_mla" else "combined"
        lines.append(
            f"   fp32 input vs ours, {variant}: {recall}{what} error "
            f"{-c['error_reduction']:+.6f} (se {c['error_reduction_se']:.6f}, "
            f"{-c['error_reduction_relative']:+.1%}) -> {verdict}"
        )
    return lines


def _compact(value: Any) -> Any:
    """``value`` with every float kept to 6 significant digits (the JSON
    holds per-query figures; more digits only add bytes)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


def _parse_context(text: str) -> int:
    t = text.strip().upper()
    return int(t[:-1]) * 1024 if t.endswith("K") else int(t)


def _environment(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.is_file():
            for line in cpuinfo.read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    git_head = ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"]
    try:
        commit = subprocess.check_output(git_head, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "device": str(device),
        "device_name": name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--contexts",
        nargs="+",
        type=_parse_context,
        default=[4096, 32768, 131072],
        help="context lengths (4K, 32K, 128K or token counts)",
    )
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--num-queries", type=int, default=32)
    p.add_argument(
        "--mla-heads",
        type=int,
        default=96,
        help="MLA heads of the calibrated recipes (96 at TP1; tiny uses its own)",
    )
    p.add_argument(
        "--logit-std",
        type=float,
        default=LOGIT_STD,
        help="std of a head's MLA logits over the context in the structured "
        "and gaussian recipes (lower: broader attention)",
    )
    p.add_argument(
        "--recipes", nargs="+", choices=RECIPES, default=["structured", "gaussian"]
    )
    p.add_argument(
        "--tiny-checkpoint-activations",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="add the tiny recipe: the tiny checkpoint in DIR, or a fresh one "
        "written to a temporary directory when DIR is omitted",
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cpu", "cuda"],
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    # The reference is fp32: no TF32 matmuls on a GPU.
    torch.set_float32_matmul_precision("highest")
    recipes = list(dict.fromkeys(args.recipes))
    tiny_dir: Path | None = None
    written: Path | None = None
    if args.tiny_checkpoint_activations is not None and "tiny" not in recipes:
        recipes.append("tiny")
    if "tiny" in recipes:
        given = args.tiny_checkpoint_activations
        if given:
            tiny_dir = Path(given)
        else:
            tiny_dir = written = write_tiny_checkpoint_dir(args.seed)
    env = _environment(device)
    started = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"DSA fidelity: {env['device_name']} ({env['device']}, {env['threads']} "
        f"threads), torch {env['torch']}, commit {env['commit']}, "
        f"{started:%Y-%m-%d %H:%M} UTC",
        flush=True,
    )
    cases = []
    try:
        for recipe in recipes:
            for context in args.contexts:
                print(f"\nrunning {recipe}, context {_ctx(context)} ...", flush=True)
                case = run_case(recipe, context, args, device, tiny_dir)
                cases.append(case)
                print("\n".join(format_case(case)), flush=True)
    finally:
        if written is not None:
            shutil.rmtree(written, ignore_errors=True)
    misses = [
        (c["recipe"], c["context"], r["variant"], r["source"], t["name"], t["miss_by"])
        for c in cases
        for r in c["rows"]
        for t in r["targets"]
        if not t["passed"]
    ]
    print(f"\ntargets missed: {len(misses)}")
    for m in misses:
        print(f"   {m[0]} {_ctx(m[1])} {m[2]} ({m[3]} input): {m[4]} by {m[5]:.4f}")
    if args.json is not None:
        report = {
            "benchmark": "kimi_k3_dsa_fidelity",
            "started": started.isoformat(),
            "environment": env,
            "args": {
                k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            },
            "tiny_checkpoint": (
                "written to a temporary directory, removed after the run"
                if written is not None
                else str(tiny_dir)
                if tiny_dir is not None
                else None
            ),
            "cases": cases,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_compact(report), indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
