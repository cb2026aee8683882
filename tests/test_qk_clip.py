"""MuonClip's QK-clip (optim/qk_clip.py, models/qk_record.py): the rule, the recording, and the
DeepSpeed runs against a single-process reference written here from the published rule.

Reference (one process): ZeRO's averaged gradient (canzona_testkit.models.reference_grads, exact at
DP <= 2; at ZeRO-3 the model's autograd sums in ZeRO-3's association,
canzona_testkit.zero3.sum_gradients_as_zero3), ``torch.optim.Muon`` on the 2-D projections +
``torch.optim.AdamW`` on the rest, then
the clip computed HERE from the logits of the reference model's own forward passes (every
micro-batch of every DP rank of the step; q and k rebuilt from each attention layer's input with
the model's rotary tables, the full score matrix materialised, causal mask applied)::

    S_h = max logit of query head h;  gamma_h = tau / S_h where S_h > tau
    MHA: W_q[h rows] *= torch.sqrt(tau / S_h),  W_k[h rows] *= torch.sqrt(tau / S_h)
    GQA: key head g by sqrt(min gamma of its group); query head h by sqrt(gamma_h) if it is the
         group's minimum, else min(1, gamma_h / sqrt(gamma_min))      (docs/qk_clip.md)

Bit for bit in fp32: the same kernels run on both sides (1 thread per rank and in the
reference; the logits of the implementation's one block equal the test's full matrix at T=12).

Cost: 32 rank runs, 2 launching tests; 69 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

from canzona_testkit.kernels import assert_bits, test_threads
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from canzona_ds.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, apply_rope
from canzona_ds.config import CanzonaConfig
from canzona_ds.optim.qk_clip import QKClipConfig, max_logits, qk_clip_scales
from canzona_testkit.dist import run_distributed
from canzona_testkit.models import HP, ds_config, max_abs_diff, params_of, reference_grads, run_engine

VOCAB, T, STEPS, MICRO = 48, 12, 4, 2
#: below the heads' logits on every step (init_std 0.3 gives logits ~1-4): most heads clip
LOW_TAU = 0.5
#: far above any logit this model reaches in STEPS steps: nothing clips
HIGH_TAU = 1e4


# ---------------------------------------------------------------------------- the rule
def test_mha_factors_are_the_published_sqrt():
    s = torch.tensor([3.0, 0.5, 7.25, 2.0])
    q, k = qk_clip_scales(s, 2.0, num_kv_heads=4)
    expect = torch.tensor([torch.sqrt(torch.tensor(2.0) / s[0]), 1.0, torch.sqrt(torch.tensor(2.0) / s[2]), 1.0])
    assert torch.equal(q, expect) and torch.equal(k, expect)


@pytest.mark.parametrize("seed", range(5))
def test_gqa_factors_never_raise_and_cap_every_clipped_head(seed):
    g = torch.Generator().manual_seed(seed)
    H, KV, tau = 12, 3, 2.0
    s = torch.rand(H, generator=g) * 5
    s[:4] = torch.rand(4, generator=g)  # group 0 never clips
    q, k = qk_clip_scales(s, tau, KV)
    factor = q * k.repeat_interleave(H // KV)      # each head's logit factor (bilinear)
    assert (q <= 1).all() and (k <= 1).all()       # no weight grows
    assert (factor <= 1).all()                     # no logit grows
    assert (s * factor <= tau * (1 + 1e-6))[s > tau].all()  # every clipped head capped
    assert torch.equal(q[:4], torch.ones(4)) and k[0] == 1  # an unclipped group untouched
    for grp in range(1, KV):  # the group's worst head lands on tau (to rounding)
        worst = grp * (H // KV) + int(s[grp * (H // KV):(grp + 1) * (H // KV)].argmax())
        if s[worst] > tau:
            assert abs(float(s[worst] * factor[worst]) - tau) < 1e-5


def _full_max(q, k, scale, allowed):
    """Each head's largest logit over the allowed pairs, from the whole score matrix at once: each
    key head against its query heads as one (B, KV, H/KV, T, d) @ (B, KV, 1, d, T) product, the
    kernel and shapes max_logits runs when all T rows fit one block (T <= BLOCK, as in the runs
    below), so a clipped run and its reference reach every logit through the same GEMM and the
    runs compare bit for bit (masking and max are exact).  Block by block the GEMM shapes differ:
    test_max_logits_blockwise_equals_the_full_matrix bounds that."""
    B, H, L, d = q.shape
    KV = k.shape[1]
    scores = torch.matmul(q.reshape(B, KV, H // KV, L, d), k.transpose(-1, -2)[:, :, None])
    scores = (scores * scale).reshape(B, H, L, k.shape[2])
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("block", [1, 5, 256])
def test_max_logits_blockwise_equals_the_full_matrix(block):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    pad = causal.clone().expand(2, 1, 11, 11).clone()
    pad[1, :, :, :3] = False
    additive = torch.zeros(2, 1, 11, 11).masked_fill(~pad, torch.finfo(torch.float32).min)
    # The blockwise code and an independent full-matrix reference (repeat_interleave + one matmul)
    # reach each logit through different matmul kernels, so their dot products may round differently
    # on some CPUs (an AMD EPYC: 2.4e-7 apart with one block).  Each side's 8-term fp32 dot product is
    # within gamma_8 * sum|q_i k_i| of the exact one (Higham, gamma_n = n u / (1 - n u), u = 2^-24),
    # the scale's product adds an ulp, and a max moves by no more than its largest entry: the bound.
    bound = _dot_product_bound(q, k, 0.3)
    for mask, allowed, is_causal in ((None, causal, True), (pad, pad, False), (additive, pad, False)):
        got = max_logits(q, k, 0.3, mask, causal=is_causal, block=block)
        torch.testing.assert_close(got, _repeated_max(q, k, 0.3, allowed), rtol=0, atol=bound)
        if block >= q.shape[2]:  # one block: _full_max's GEMM on the same shapes, the runs' premise
            torch.testing.assert_close(got, _full_max(q, k, 0.3, allowed), rtol=0, atol=0)


def _repeated_max(q, k, scale, allowed):
    """The largest logits written another way: every query head against its key head repeated."""
    rep = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


def _dot_product_bound(q, k, scale) -> float:
    """Two fp32 evaluations of ``scale * (q . k)`` in any summation order differ by at most this."""
    d, u = q.shape[-1], 2.0 ** -24
    gamma = d * u / (1 - d * u)
    rep = q.shape[1] // k.shape[1]
    abs_dots = q.double().abs() @ k.double().abs().repeat_interleave(rep, 1).transpose(-1, -2)
    largest = float(abs_dots.max()) * scale
    return 2 * (gamma * largest + u * largest)


def test_config_errors_name_the_value():
    for bad, what in (({"threshold": -1}, "qk_clip.threshold=-1"), ({"threshold": "x"}, "qk_clip.threshold='x'"),
                      ({"tau": 3}, "['tau']"), (5, "qk_clip=5")):
        with pytest.raises((ValueError, TypeError), match=__import__("re").escape(what)):
            CanzonaConfig.from_ds("CanzonaMuon", {"qk_clip": bad})
    for t in ("CanzonaMuon", "CanzonaShampoo", "CanzonaSOAP"):
        assert CanzonaConfig.from_ds(t, {"qk_clip": {"threshold": 30}}).qk_clip == QKClipConfig(30.0)
        assert CanzonaConfig.from_ds(t, {}).qk_clip is None  # off by default
        assert "qk_clip" not in CanzonaConfig.from_ds(t, {}).describe()


# ---------------------------------------------------------------------------- recording
def _hf_llama(impl: str, kv: int = 2, qwen3: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config as HFQwen3Config, Qwen3ForCausalLM as HFQwen3

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=kv, max_position_embeddings=64, attn_implementation=impl)
    torch.manual_seed(0)
    if qwen3:
        return HFQwen3(HFQwen3Config(head_dim=8, **kw))
    m = LlamaForCausalLM(LlamaConfig(initializer_range=0.3, **kw))
    return m


def _hf_reference_maxima(model, x, attention_mask):
    """Each layer's per-head max logit, computed here from the layer's input."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out = []

    def hook(mod, args, kwargs, _):
        h = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        B, L, _ = h.shape
        q = mod.q_proj(h).view(B, L, -1, mod.head_dim).transpose(1, 2)
        k = mod.k_proj(h).view(B, L, -1, mod.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        allowed = torch.ones(L, L, dtype=torch.bool).tril().expand(B, 1, L, L)
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        out.append(_full_max(q.detach(), k.detach(), mod.scaling, allowed))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()
               if type(m).__name__ == "LlamaAttention"]
    with torch.no_grad():
        model(input_ids=x, attention_mask=attention_mask)
    for h in handles:
        h.remove()
    return out


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kv", [2, 4])
def test_hf_recorder_keeps_the_output_and_records_the_maxima(impl, kv):
    from canzona_ds.models.qk_record import attach

    model = _hf_llama(impl, kv)
    model.train()
    own = copy.deepcopy(model)
    layers = attach([(model, "")])
    assert [l.q_name for l in layers] == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)]
    assert model.config._attn_implementation == f"canzona_qk_record|{impl}"
    x = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(3))
    pad = torch.ones(2, T, dtype=torch.long)
    pad[1, :4] = 0
    for mask in (None, pad):
        for l in layers:
            l.running = None
        with torch.no_grad():
            got = model(input_ids=x, attention_mask=mask).logits
            expect = own(input_ids=x, attention_mask=mask).logits
        assert torch.equal(got, expect), f"the recording attention changed the {impl} output"
        ref = _hf_reference_maxima(own, x, mask)
        for l, r in zip(layers, ref):
            torch.testing.assert_close(l.running, r, rtol=0, atol=0)
    model.eval()  # evaluation forwards record nothing
    for l in layers:
        l.running = None
    with torch.no_grad():
        model(input_ids=x)
    assert all(l.running is None for l in layers)


def test_unrecognised_attention_and_silent_layers_are_refused():
    from canzona_ds.models.qk_record import attach
    from canzona_ds.optim.qk_clip import AttentionLayer, QKClip
    from canzona_testkit.models import TinyAttention

    with pytest.raises(ValueError, match=r"attention layer '' \(TinyAttention\) is neither"):
        attach([(TinyAttention(), "")])
    layers = [AttentionLayer("a.q", "a.k", 2, 1, 4), AttentionLayer("b.q", "b.k", 2, 1, 4)]
    layers[0].running = torch.tensor([1.0, 2.0])
    with pytest.raises(RuntimeError, match="'b.q' recorded no logit"):
        QKClip(QKClipConfig(1.0), layers).row_scales(1)


def test_qk_norm_models_are_refused_by_name():
    from canzona_ds.models.qk_record import attach

    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn' has QK-norm \(q_norm\)"):
        attach([(Qwen3ForCausalLM(Qwen3Config(num_layers=1)), "")])
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn' has QK-norm \(q_norm\)"):
        attach([(_hf_llama("sdpa", qwen3=True), "")])


# ---------------------------------------------------------------------------- DeepSpeed runs
class LM(nn.Module):
    """The project's model without QK-norm, taking (x, y) -> loss as the runners expect."""

    def __init__(self, kv: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # (build_model(LM.config(kv), 0)'s values: what Qwen3Pipe(cfg, 0) holds)
        self.lm = Qwen3ForCausalLM(self.config(kv))

    @staticmethod
    def config(kv: int) -> Qwen3Config:
        return Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=kv, head_dim=8, max_seq_len=T, qk_norm=False, init_std=0.3)

    def forward(self, x, y):
        return self.lm(x, y)[1]

    @staticmethod
    def attention_modules(model):
        return [m for m in model.modules() if type(m).__name__ == "Attention"]

    @staticmethod
    def q_k_scale(mod, args, kwargs):
        """q, k (after RoPE) and the softmax scale of one forward of the project's Attention."""
        x, cos, sin = args
        B, L, _ = x.shape
        q = apply_rope(mod.q_proj(x).view(B, L, mod.num_heads, -1).transpose(1, 2), cos, sin)
        k = apply_rope(mod.k_proj(x).view(B, L, mod.num_kv_heads, -1).transpose(1, 2), cos, sin)
        return q, k, mod.head_dim ** -0.5, mod.num_heads, mod.num_kv_heads, mod.head_dim


class HFLM(nn.Module):
    """A real transformers ``LlamaForCausalLM`` (SDPA), (x, y) -> loss."""

    def __init__(self, kv: int) -> None:
        super().__init__()
        self.lm = _hf_llama("sdpa", kv)
        self.config = self.lm.config  # (DeepSpeed's per-head resolution reads the root's config)

    def forward(self, x, y):
        return F.cross_entropy(self.lm(input_ids=x).logits.flatten(0, 1).float(), y.flatten())

    @staticmethod
    def attention_modules(model):
        return [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]

    @staticmethod
    def q_k_scale(mod, args, kwargs):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        h = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        B, L, _ = h.shape
        q = mod.q_proj(h).view(B, L, -1, mod.head_dim).transpose(1, 2)
        k = mod.k_proj(h).view(B, L, -1, mod.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, mod.scaling, q.shape[1], k.shape[1], mod.head_dim


MODELS = {"own": LM, "hf": HFLM}


def _data(steps: int, dp: int, gas: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (MICRO * dp, T), generator=g), torch.randint(0, VOCAB, (MICRO * dp, T),
                                                                                   generator=g))
            for _ in range(steps * gas)]


def _params(tau):
    return {**HP["CanzonaMuon"], "qk_clip": {"threshold": tau}}


def _worker(rank, dp, kv, tau, stage, gas, kind="own", zero_extra=None, params_extra=None):
    from canzona_ds.integration.runtime_info import canzona_optimizer

    stats = {}  # step -> figures (DeepSpeed MoE's two matrix groups call row_scales twice a step)
    recorder = []  # DeepSpeed MoE: the gradients each owner's matrices received

    def after_init(engine):
        if kind.startswith("dsmoe"):
            from canzona_testkit.models import MatrixStepRecorder

            recorder.append(MatrixStepRecorder(canzona_optimizer(engine)))
        qk = canzona_optimizer(engine).qk_clip
        stock = qk.row_scales

        def row_scales(step, device=None):
            out = stock(step, device)
            stats[step] = (qk.stats.clipped_heads, qk.stats.max_logit)
            return out

        qk.row_scales = row_scales

    cfg = ds_config(dp, micro=MICRO, gas=gas, params={**_params(tau), **(params_extra or {})}, stage=stage)
    cfg["zero_optimization"].update(zero_extra or {})
    if stage == 3:  # every parameter partitioned, however small (canzona_testkit.zero3)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    params, _, engine = run_engine(rank, dp, cfg, STEPS, micro=MICRO, gas=gas, model=MODELS[kind](kv),
                                   after_init=after_init, data=_data(STEPS, dp, gas))
    if stage == 3:
        from canzona_testkit.zero3 import gathered_params

        params = gathered_params(engine.module)
    expert_grads = {}
    if recorder:  # the first step's expert gradients this rank owns (ZeRO's average), by global name
        from canzona_testkit.moe import global_name

        local = 1 if kind == "dsmoe-ep2" else 2  # (ep_size 2: this rank's local expert 0 is global expert `rank`)
        expert_grads = {global_name(n, rank if local == 1 else 0, local): g.numpy()
                        for n, (g, _, _) in recorder[0].steps[0].items() if "deepspeed_experts" in n}
    if kind == "dsmoe-ep2":
        from canzona_testkit.moe import global_name

        params = {global_name(n, rank, 1): v for n, v in params.items()}
    hosted = canzona_optimizer(engine).placement.hosted
    return dict(params=params, stats=[stats[k] for k in sorted(stats)], expert_grads=expert_grads,
                bytes=canzona_optimizer(engine).qk_clip.collective_bytes,
                split=sorted(hosted.split) if hosted is not None else [])


def _published_clip(Wq, Wk, S, tau, KV, d) -> int:
    """The clip, written from the published rule (module docstring), on whole W_q / W_k in place;
    returns the heads that clipped."""
    H = S.numel()
    G = H // KV
    gam = torch.where(S > tau, torch.tensor(tau) / S, torch.ones_like(S))
    for g in range(KV):
        heads = range(g * G, (g + 1) * G)
        gmin = min(float(gam[h]) for h in heads)
        if gmin >= 1.0:  # (gamma is min(tau / S, 1))
            continue
        ks = torch.sqrt(gam[min(heads, key=lambda h: float(gam[h]))])
        Wk[g * d:(g + 1) * d] *= ks
        for h in heads:
            qs = torch.sqrt(torch.tensor(tau) / S[h]) if float(gam[h]) == gmin else torch.clamp(gam[h] / ks, max=1.0)
            Wq[h * d:(h + 1) * d] *= qs
    return int((S > tau).sum())


def _reference(dp, kv, tau, stage, gas, kind="own", model=None, grads_fn=reference_grads):
    """torch.optim.Muon + torch.optim.AdamW on ZeRO's averaged gradients, then the published clip."""
    torch.set_num_threads(test_threads())
    cls = MODELS[kind]
    model = cls(kv) if model is None else model
    hp = HP["CanzonaMuon"]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    mats = [p for n, p in named if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
    rest = [p for n, p in named if not (p.ndim == 2 and "embed" not in n and "lm_head" not in n)]
    muon = torch.optim.Muon(mats, lr=hp["lr"], weight_decay=hp["weight_decay"], momentum=hp["momentum"])
    adamw = torch.optim.AdamW(rest, lr=hp["adam_lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                              weight_decay=hp["weight_decay"])
    if stage == 3:  # ZeRO-3's association of gradient sums (the math is the same)
        from canzona_testkit.zero3 import sum_gradients_as_zero3

        sum_gradients_as_zero3(model)
    attn = cls.attention_modules(model)
    assert attn
    maxima: dict[int, torch.Tensor] = {}
    shape: dict[int, tuple] = {}

    def hook(mod, args, kwargs, _):
        q, k, scale, H, KV, d = cls.q_k_scale(mod, args, kwargs)
        L = q.shape[2]
        m = _full_max(q.detach(), k.detach(), scale, torch.ones(L, L, dtype=torch.bool).tril())
        maxima[id(mod)] = m if id(mod) not in maxima else torch.maximum(maxima[id(mod)], m)
        shape[id(mod)] = (H, KV, d)

    for m in attn:
        m.register_forward_hook(hook, with_kwargs=True)
    data, clipped = _data(STEPS, dp, gas), []
    for s in range(STEPS):
        chunk = data[s * gas:(s + 1) * gas]
        maxima.clear()
        grads = grads_fn(model, [c[0] for c in chunk], [c[1] for c in chunk], dp, MICRO, gas, stage)
        for n, p in named:
            p.grad = grads[n]
        muon.step()
        adamw.step()
        n_clipped = 0
        with torch.no_grad():
            for mod in attn:
                H, KV, d = shape[id(mod)]
                n_clipped += _published_clip(mod.q_proj.weight, mod.k_proj.weight, maxima[id(mod)], tau, KV, d)
        clipped.append(n_clipped)
    return params_of(model), clipped


CASES = {  # name: (dp, kv, stage, gas[, model, zero_optimization extra])
    "dp1-gqa-z1": (1, 2, 1, 1),
    "dp2-gqa-z1-offload": (2, 2, 1, 1, "own", {"offload_optimizer": {"device": "cpu"}}),
    "dp2-hf-llama-gqa-z1": (2, 2, 1, 1, "hf"),
    "dp2-mha-z1-mixed": (2, 4, 1, 1, "own", {}, {"layout": "mixed"}),
    "dp2-hf-llama-mha-z2": (2, 4, 2, 1, "hf"),
    "dp2-gqa-z1": (2, 2, 1, 1),
    "dp2-mha-z2": (2, 4, 2, 1),
    "dp2-gqa-z2-gas2": (2, 2, 2, 2),
    "dp2-mha-z0": (2, 4, 0, 1),
    "dp1-mha-z3": (1, 4, 3, 1),
    "dp2-gqa-z3": (2, 2, 3, 1),
    "dp2-hf-llama-gqa-z3": (2, 2, 3, 1, "hf"),
}


NEVER_CLIP_CASES = ("dp2-gqa-z1", "dp2-hf-llama-mha-z2")


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_clipped_runs_equal_the_reference(case):
    dp, kv, stage, gas, *extra = CASES[case]
    # the never-clipping threshold on two cases only (suite time): one per model
    for tau in (LOW_TAU, HIGH_TAU) if case in NEVER_CLIP_CASES else (LOW_TAU,):
        res = run_distributed(_worker, dp, kv, tau, stage, gas, *extra)
        ref, ref_clipped = _reference(dp, kv, tau, stage, gas, *extra[:1])
        for r in res:
            assert_bits(max_abs_diff(r["params"], ref), 0.0, f"{case} tau={tau}: differs from Muon + AdamW + clip")
            assert [c for c, _ in r["stats"]] == ref_clipped
        if tau == LOW_TAU:  # heads really clip, on most steps, and that changes the weights
            assert sum(c > 0 for c in ref_clipped) >= STEPS - 1, ref_clipped
            assert max_abs_diff(ref, _reference(dp, kv, float("inf"), stage, gas, *extra[:1])[0]) > 1e-3
        else:  # nothing clips, so the run equals plain Muon + AdamW
            assert ref_clipped == [0] * STEPS
            unclipped, _ = _reference(dp, kv, float("inf"), stage, gas, *extra[:1])
            assert_bits(max_abs_diff(ref, unclipped), 0.0)
        assert res[0]["stats"][0][1] > 0  # the max logit was recorded
        if "mixed" in case:  # q/k projections really went through the hosted (piece) path
            assert any("q_proj" in n or "k_proj" in n for n in res[0]["split"]), res[0]["split"]
        if stage == 3 and dp > 1:  # ZeRO-3: every q and k cut in flat pieces over DP, each scaled by its rank
            assert all(any(w in n for n in res[0]["split"]) for w in ("q_proj", "k_proj")), res[0]["split"]


def _refusal_worker(rank, dp):
    import canzona_ds  # noqa: F401
    import deepspeed

    out = {}
    cases = {
        "qk_norm": (dict(stage=1), {}, None),
        "adamw_q": (dict(stage=1), {"matrix_exclude": ["embed", "lm_head", "q_proj"]}, LM(2)),
    }
    for name, (extra, params, model) in cases.items():
        if model is None:  # the project's default: Qwen3 with QK-norm
            model = LM(2)
            model.lm = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8))
        cfg = ds_config(dp, micro=MICRO, params={**_params(1.0), **params}, **extra)
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.mark.dist
def test_what_qk_clip_does_not_cover_is_refused_by_name():
    res = run_distributed(_refusal_worker, 1)[0]
    expect = {
              "qk_norm": "'lm.model.layers.0.self_attn' has QK-norm (q_norm)",
              "adamw_q": "'lm.model.layers.0.self_attn.q_proj.weight' is an AdamW parameter"}
    for name, text in expect.items():
        assert res[name] is not None and text in res[name], (name, res[name])


def _pipeline_without_attention_worker(rank, world):
    import canzona_ds  # noqa: F401
    import deepspeed

    from canzona_testkit.pipeline import build_pipe

    module = build_pipe(2)  # the pipeline kit's decoder: MLP blocks, no attention on either stage
    cfg = ds_config(1, micro=MICRO, params=_params(1.0))
    try:
        deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
                             config=cfg)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_a_pipeline_with_no_attention_on_any_stage_is_refused():
    """Each stage may hold no attention layer; the whole pipeline holding none is refused on
    every stage (it would clip nothing, silently)."""
    for msg in run_distributed(_pipeline_without_attention_worker, 2):
        assert msg is not None and "no attention layer it can clip" in msg and "2 pipeline stages" in msg, msg


@pytest.mark.dist
def test_main_job_logs_the_max_logit_and_clipped_heads(tmp_path):
    """configs/run_tiny_qkclip.yaml through DeepSpeed's launcher (2 ranks), its ds_config with a
    threshold below the tiny model's first logits (~0.26) so heads clip: every step's row has
    qk_max_logit and qk_clipped_heads, and the run folder the plot.  The same run checks the
    optimizer's step metrics in the job (canzona_* columns, the same source as the figures
    above) and in the user's own DeepSpeed monitor: the ds_config's csv_monitor gets rank 0's
    Train/Canzona/* at the engine's global steps, the values metrics.jsonl holds."""
    import json

    from test_train_job import launch, rows

    from canzona_ds.train.metrics import have_matplotlib

    from pathlib import Path

    ds = json.loads((Path(__file__).resolve().parents[1] / "configs" / "ds_cpu_canzona_qkclip.json").read_text())
    ds["optimizer"]["params"]["qk_clip"]["threshold"] = 0.2
    ds["canzona_metrics"] = {"interval": 2}
    ds["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "monitor"), "job_name": "job"}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    r = launch(["--config", "configs/run_tiny_qkclip.yaml", "--set", "steps=4", "--set", f"log_dir={tmp_path}/run",
                "--set", "checkpoint_every=0", "--set", "eval_every=0", "--ds-config", str(tmp_path / "ds.json")])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = rows(tmp_path / "run" / "metrics.jsonl")
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    assert all(x["qk_max_logit"] > 0.2 and x["qk_clipped_heads"] > 0 for x in m), m
    assert "qk_max_logit" in (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0]
    for x in m:  # dp=2, tp=pp=1: rank 0's QK figures are the whole model's
        assert (x["canzona_qk_max_logit"], x["canzona_qk_clipped_heads"]) == (x["qk_max_logit"],
                                                                              x["qk_clipped_heads"])
        assert 0 < x["canzona_matrix_ms"] <= x["canzona_step_ms"] and not x["canzona_skipped"]
        assert ("canzona_dp_max_step_ms" in x) == (x["step"] % 2 == 0)
        if x["step"] % 2 == 0:
            assert x["canzona_dp_max_step_ms"] >= max(x["canzona_step_ms"], x["canzona_dp_mean_step_ms"])
    for name in ("step_ms", "qk_max_logit", "qk_clipped_heads", "dp_mean_step_ms"):
        lines = (tmp_path / "monitor" / "job" / f"Train_Canzona_{name}.csv").read_text().split()
        assert lines[0] == f"step,{name}"
        assert [tuple(map(float, line.split(","))) for line in lines[1:]] == [
            (x["step"], x[f"canzona_{name}"]) for x in m if f"canzona_{name}" in x]
    if have_matplotlib():
        assert (tmp_path / "run" / "qk_logits.png").is_file()


def _pipe_worker(rank, world, pp, kv, tau, gas):
    """The project's model as a DeepSpeed PipelineModule (models/qwen3_pipe.Qwen3Pipe: one decoder
    layer per stage at pp=2) with qk_clip, ZeRO-1, ``world // pp`` DP ranks, ``gas`` micro-batches
    per train_batch: this stage's whole parameters by the plain model's names, its clipped heads
    per step and the layers it recorded."""
    import canzona_ds  # noqa: F401
    import deepspeed
    from canzona_ds.integration.runtime_info import canzona_optimizer
    from canzona_ds.models.qwen3_pipe import Qwen3Pipe

    torch.set_num_threads(test_threads())
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    dp = world // pp
    pipe = Qwen3Pipe(LM.config(kv), 0, num_stages=pp)
    engine, *_ = deepspeed.initialize(model=pipe, model_parameters=list(pipe.parameters()),
                                      config=ds_config(dp, micro=MICRO, gas=gas, params=_params(tau), stage=1))
    opt = canzona_optimizer(engine)
    stats, stock = {}, opt.qk_clip.row_scales

    def row_scales(step, device=None):
        out = stock(step, device)
        stats[step] = opt.qk_clip.stats.clipped_heads
        return out

    opt.qk_clip.row_scales = row_scales
    d = engine.grid.get_data_parallel_id()
    rows = slice(d * MICRO, (d + 1) * MICRO)  # DP rank d's rows of every global micro-batch (reference_grads)
    batches = iter([(x[rows], y[rows]) for x, y in _data(STEPS, dp, gas)])
    for _ in range(STEPS):
        engine.train_batch(batches)
    names = pipe.canonical_names()
    return dict(params={"lm." + names[n]: p.detach().numpy().copy() for n, p in pipe.named_parameters()},
                stats=[stats[k] for k in sorted(stats)], stage=engine.stage_id,
                layers=[l.q_name for l in opt.qk_clip.layers])


PIPE_CASES = {  # name: (world, pp, kv, gas)
    "pp2-gqa-gas2": (2, 2, 2, 2),
    "pp2-dp2-mha-gas2": (4, 2, 4, 2),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", list(PIPE_CASES))
def test_pipeline_runs_equal_the_reference(case):
    """PP=2 (DeepSpeed's PipelineEngine, 1F1B over ``gas`` micro-batches; each stage records its
    own layer, reduces over its DP group and clips it) against the single-process reference (the
    plain model's own forward, torch Muon + AdamW, the published clip from the maxima of every
    micro-batch of the step): bit for bit in fp32 (the pipeline's arithmetic is the plain model's:
    tests/test_qwen3_pipe.py), heads clipping on most steps on each stage."""
    world, pp, kv, gas = PIPE_CASES[case]
    res = run_distributed(_pipe_worker, world, pp, kv, LOW_TAU, gas)
    ref, ref_clipped = _reference(world // pp, kv, LOW_TAU, 1, gas)
    per_stage = {r["stage"]: r for r in res}
    assert sorted(per_stage) == list(range(pp))
    # each stage recorded and clipped its own attention layer only
    assert [per_stage[s]["layers"] for s in range(pp)] == [[f"{s}.self_attn.q_proj.weight"] for s in range(1, pp + 1)]
    whole = {}
    for r in res:
        for n, v in r["params"].items():
            if n in whole:
                assert_bits(v, whole[n], n)  # DP replicas agree
            whole[n] = v
    assert whole.keys() == ref.keys()
    assert_bits(max_abs_diff(whole, ref), 0.0, f"{case}: differs from Muon + AdamW + clip")
    assert [sum(c) for c in zip(*(per_stage[s]["stats"] for s in range(pp)))] == ref_clipped
    assert all(sum(c > 0 for c in per_stage[s]["stats"]) >= STEPS - 1 for s in range(pp)), per_stage
    assert max_abs_diff(ref, _reference(world // pp, kv, float("inf"), 1, gas)[0]) > 1e-3


@pytest.mark.dist
def test_pipeline_pp2_equals_the_pp1_job(tmp_path):
    """The main job with qk_clip (threshold below the first logits) at pp=2 (2 ranks: 2 stages x
    DP 1; each stage records, reduces and clips its own layers) against the same job at pp=1 on
    one rank, same global batches (8 = micro 4 x accumulation 2): the clipped heads (summed over
    stages) and the largest logit (max over stages) equal every step, the losses to one fp32 ulp
    (train_batch averages the micro-batch losses in fp32, the pp=1 job in float64:
    tests/test_train_pipeline.py)."""
    import json
    from pathlib import Path

    import numpy as np
    from test_train_job import launch, rows

    ds = json.loads((Path(__file__).resolve().parents[1] / "configs" / "ds_cpu_canzona_qkclip.json").read_text())
    ds["optimizer"]["params"]["qk_clip"]["threshold"] = 0.2
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    common = ["--config", "configs/run_tiny_qkclip.yaml", "--set", "global_batch=8", "--set", "grad_accum=null",
              "--set", "steps=4", "--set", "checkpoint_every=0", "--set", "eval_every=0",
              "--ds-config", str(tmp_path / "ds.json")]
    runs = {}
    for pp, ranks in ((2, 2), (1, 1)):
        r = launch([*common, "--set", f"pp={pp}", "--set", f"log_dir={tmp_path}/pp{pp}"], ranks=ranks)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[pp] = rows(tmp_path / f"pp{pp}" / "metrics.jsonl")
    assert all(x["qk_clipped_heads"] > 0 for x in runs[1]), runs[1]
    for a, b in zip(runs[2], runs[1]):
        assert a["qk_clipped_heads"] == b["qk_clipped_heads"] and a["qk_max_logit"] == b["qk_max_logit"], (a, b)
        assert abs(a["loss"] - b["loss"]) <= np.spacing(np.float32(b["loss"])), (a["loss"], b["loss"])


class Mixtral(nn.Module):
    """A real transformers ``MixtralForCausalLM`` (Llama-style attention, experts as 3-D stacks)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        torch.manual_seed(0)
        self.lm = MixtralForCausalLM(MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            initializer_range=0.3, attn_implementation="sdpa"))
        self.config = self.lm.config

    def forward(self, x, y):
        return F.cross_entropy(self.lm(input_ids=x).logits.flatten(0, 1).float(), y.flatten())


def _mixed_precision_worker(rank, dp, kind):
    """bf16: every owner's step replayed from what it received (the rule, then this test's
    published clip from the step's reduced maxima) bit for bit, and the bf16 weights equal to the
    clipped fp32 master.  fp16: an overflow-skipped step clips nothing and forgets its maxima."""
    import canzona_ds  # noqa: F401
    import deepspeed

    from canzona_ds.integration.accelerator import allow_fp16
    from canzona_ds.integration.runtime_info import canzona_optimizer
    from canzona_ds.optim.rule import rule_step
    from canzona_testkit.models import MatrixStepRecorder

    extra = {"bf16": {"bf16": {"enabled": True}}, "moe": {}, "per_head": {},
             "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000,
                               "hysteresis": 1}}}[kind]
    with allow_fp16():
        model = Mixtral() if kind == "moe" else HFLM(2) if kind == "per_head" else LM(2)
        params = {**_params(LOW_TAU), "per_head_muon": kind == "per_head"}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(dp, micro=MICRO, params=params, **extra))
        opt = canzona_optimizer(engine)
        rec = MatrixStepRecorder(opt)
        maxima, stock = [], opt.qk_clip.row_scales

        def row_scales(step, device=None):
            out = stock(step, device)
            maxima.append((dict(opt.qk_clip.stats.per_layer), opt.qk_clip.stats.clipped_heads))
            return out

        opt.qk_clip.row_scales = row_scales
        out = {"after_skip_running": None}
        for s, (x, y) in enumerate(_data(STEPS, dp, 1)):
            x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
            loss = engine(x, y)
            if kind == "fp16" and s == 1:
                loss = loss * torch.tensor(float("inf"))
            engine.backward(loss)
            engine.step()
            if kind == "fp16" and s == 1:
                out["after_skip_running"] = [l.running for l in opt.qk_clip.layers]
                out["skipped"] = engine.skipped_steps
    out["clipped"] = [c for _, c in maxima]
    # replay every owned matrix: rule, then the clip of its head rows
    worst, state = 0.0, {}
    layer_of = {n: l for l in opt.qk_clip.layers for n in (l.q_name, l.k_name)}
    group = next(g for g in opt.param_groups if g["canzona_role"] == "matrix")
    for t, record in enumerate(rec.steps):
        for name, (grad, before, after) in record.items():
            W = before.clone()
            rule_step(opt.rule, W, grad.clone(), state, opt.infos[name], rec.start_step + t + 1, group["lr"],
                      group["weight_decay"])
            if name in layer_of:
                l = layer_of[name]
                S = torch.tensor(maxima[t][0][l.q_name])
                Wq, Wk = (W, torch.zeros(l.num_kv_heads * l.head_dim, 1)) if name == l.q_name else \
                    (torch.zeros(l.num_heads * l.head_dim, 1), W)
                _published_clip(Wq, Wk, S, LOW_TAU, l.num_kv_heads, l.head_dim)
            worst = max(worst, float((W - after).abs().max()))
    out["replay_max_diff"], out["replayed"] = worst, sorted({n for r in rec.steps for n in r})
    # the model's (bit16) weights are the clipped fp32 masters, cast
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kind, torch.float32)
    out["per_head_infos"] = sorted(n for n, i in opt.infos.items() if i.num_heads is not None)
    last = rec.steps[-1]
    out["bit16_follows"] = all(torch.equal(engine.module.get_parameter(n).detach(), last[n][2].to(dtype))
                               for n in last)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["bf16", "fp16", "moe", "per_head"])
def test_mixed_precision_moe_per_head_replayed(kind):
    """bf16 / fp16 (see the worker); a transformers MoE model (Mixtral: experts as 3-D stacks
    beside Llama-style attention) in fp32, whose stacks the recorder replays per expert; and
    per_head_muon (a transformers Llama, heads tagged by DeepSpeed's resolution), whose per-head
    updates the replay reruns with the same MatrixInfo, then the clip."""
    res = run_distributed(_mixed_precision_worker, 2, kind)
    if kind == "moe":
        assert any("experts" in n for r in res for n in r["replayed"])
    if kind == "per_head":
        assert any("q_proj" in n for n in res[0]["per_head_infos"]), res[0]["per_head_infos"]
    qk = [n for n in res[0]["replayed"] + res[1]["replayed"] if "q_proj" in n or "k_proj" in n]
    assert len(qk) == 4, qk  # every q/k projection (2 layers) replayed on its owner
    for r in res:
        assert_bits(r["replay_max_diff"], 0.0)
        assert r["bit16_follows"]
    applied = STEPS - 1 if kind == "fp16" else STEPS
    assert len(res[0]["clipped"]) == applied and sum(c > 0 for c in res[0]["clipped"]) >= applied - 1
    if kind == "fp16":  # the skipped step reached no optimizer step and left no maxima behind
        assert res[0]["skipped"] == 1 and all(m is None for m in res[0]["after_skip_running"])


# ---------------------------------------------------------------------------- tensor parallelism
HIDDEN, HEAD_DIM = 32, 8


class _GatherHeads(torch.autograd.Function):
    """(B, h, T, d) of this TP rank's heads -> (B, H, T, d) of every rank's, in head order (an
    all-gather); backward: this rank's heads of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, y):
        import torch.distributed as dist

        from canzona_testkit import megatron_standin as ms

        group = ms.get_tensor_model_parallel_group()
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, y.contiguous(), group=group)
        ctx.rank, ctx.h = dist.get_rank(group), y.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        return g.narrow(1, ctx.rank * ctx.h, ctx.h).contiguous()


class TPAttention(nn.Module):
    """Megatron-style tensor-parallel attention (the stand-in's ColumnParallelLinear: weights
    tagged ``tensor_model_parallel``, ``partition_dim`` 0): each TP rank computes its own query and
    key/value heads, records them (``qk_observer``, the project's protocol), and the heads'
    outputs are gathered in head order into a replicated o_proj.

    Without a TP group the projections are plain Linears holding every head, and ``shards`` = tp
    makes the layer compute as the TP ranks do, one shard's heads at a time (each shard's GEMMs
    and attention, concatenated): the same function, and the same arithmetic on every CPU (a GEMM
    over a subset of W's rows need not round as the whole GEMM's rows do, e.g. with MKL's AVX2
    kernels)."""

    def __init__(self, heads: int, kv: int, shards: int = 1) -> None:
        super().__init__()
        from canzona_testkit import megatron_standin as ms

        linear = ms.ColumnParallelLinear if ms._tp_group_or_none() is not None else \
            (lambda i, o: nn.Linear(i, o, bias=False))
        # (registered k, v, q: at DP2 x TP2 MHA the mixed layout's DP cut then falls inside q_proj,
        # which the layout hosts over the DP x TP grid)
        self.k_proj = linear(HIDDEN, kv * HEAD_DIM)
        self.v_proj = linear(HIDDEN, kv * HEAD_DIM)
        self.q_proj = linear(HIDDEN, heads * HEAD_DIM)
        self.o_proj = nn.Linear(heads * HEAD_DIM, HIDDEN, bias=False)
        self.head_dim = HEAD_DIM
        self.tp = heads * HEAD_DIM // self.q_proj.weight.shape[0]
        self.shards = shards
        self.qk_observer = None

    def project(self, x):
        """q, k, v (B, heads, L, d) of the heads this layer holds, one shard's GEMM at a time."""
        B, L, _ = x.shape
        out = []
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            y = proj(x) if self.shards == 1 else torch.cat([F.linear(x, w) for w in proj.weight.chunk(self.shards)], -1)
            out.append(y.view(B, L, -1, HEAD_DIM).transpose(1, 2))
        return out

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.project(x)
        if self.qk_observer is not None and self.training:
            self.qk_observer.observe(q, k, HEAD_DIM ** -0.5, causal=True)
        rep = q.shape[1] // k.shape[1]
        parts = zip(q.chunk(self.shards, 1), k.chunk(self.shards, 1), v.chunk(self.shards, 1))
        y = torch.cat([F.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1),
                                                      is_causal=True) for qs, ks, vs in parts], dim=1)
        if self.tp > 1:
            y = _GatherHeads.apply(y)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, -1))


class TPLM(nn.Module):
    """Frozen embedding -> one TPAttention (residual) -> RMS norm (AdamW) -> lm_head (AdamW).
    Under TP every computation outside the heads is replicated and the embedding takes no
    gradient, so no TP reduction reorders a sum: the TP run's arithmetic is the TP=1 model's, and
    the single-process reference is bit for bit comparable."""

    def __init__(self, kv: int, heads: int = 4, shards: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.embed.weight.requires_grad_(False)
        self.attn = TPAttention(heads, kv, shards)
        self.norm = nn.Parameter(torch.ones(HIDDEN))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x, y):
        h = self.embed(x)
        h = h + self.attn(h)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return F.cross_entropy(self.lm_head(h).flatten(0, 1), y.flatten())

    @staticmethod
    def full_state(kv: int, heads: int = 4) -> dict:
        g = torch.Generator().manual_seed(0)
        w = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731  (logits ~1-4: most heads clip at LOW_TAU)
        return {"embed.weight": torch.randn(VOCAB, HIDDEN, generator=g),
                "attn.q_proj.weight": w(heads * HEAD_DIM, HIDDEN),
                "attn.k_proj.weight": w(kv * HEAD_DIM, HIDDEN), "attn.v_proj.weight": w(kv * HEAD_DIM, HIDDEN),
                "attn.o_proj.weight": w(HIDDEN, heads * HEAD_DIM), "norm": torch.ones(HIDDEN),
                "lm_head.weight": w(VOCAB, HIDDEN)}

    @staticmethod
    def shard(full: dict, tp: int, rank: int) -> dict:
        split = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight")
        return {n: t.chunk(tp, dim=0)[rank].clone() if n in split else t.clone() for n, t in full.items()}

    @staticmethod
    def attention_modules(model):
        return [m for m in model.modules() if isinstance(m, TPAttention)]

    @staticmethod
    def q_k_scale(mod, args, kwargs):
        q, k, _ = mod.project(args[0])
        return q, k, HEAD_DIM ** -0.5, q.shape[1], k.shape[1], HEAD_DIM


MODELS["tp"] = TPLM


def _tp_worker(rank, world, tp, kv, tau, stage, layout):
    """DP x TP through deepspeed.initialize(mpu=...): the stand-in's Megatron groups (TP = contiguous
    ranks, DP stride tp); returns the whole (TP=1) parameters, the clip counts of this TP rank's
    heads per step, and where the q/k shards were updated."""
    import torch.distributed as dist

    import canzona_ds  # noqa: F401
    import deepspeed
    from canzona_ds.integration.runtime_info import canzona_optimizer
    from canzona_testkit import megatron_standin as ms

    torch.set_num_threads(test_threads())
    ms.initialize_model_parallel(tp)
    dp, tp_rank, dp_rank = world // tp, ms.get_tensor_model_parallel_rank(), ms.get_data_parallel_rank()
    model = TPLM(kv)
    model.load_state_dict(TPLM.shard(TPLM.full_state(kv), tp, tp_rank))
    cfg = ds_config(dp, micro=MICRO, params={**_params(tau), "layout": layout}, stage=stage)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg, mpu=ms.mpu)
    opt = canzona_optimizer(engine)
    stats, stock = [], opt.qk_clip.row_scales

    def row_scales(step, device=None):
        out = stock(step, device)
        stats.append(opt.qk_clip.stats.clipped_heads)
        return out

    opt.qk_clip.row_scales = row_scales
    for x, y in _data(STEPS, dp, 1):
        rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    local = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    shards: list = [None] * tp
    dist.all_gather_object(shards, local, group=ms.get_tensor_model_parallel_group())
    whole = {n: torch.cat([s[n] for s in shards]) if ("q_proj" in n or "k_proj" in n or "v_proj" in n) else local[n]
             for n in local}
    hosted = opt.placement.hosted
    return dict(params={n: t.numpy() for n, t in whole.items()}, stats=stats, tp_rank=tp_rank,
                split={n: type(m).__name__ for n, m in hosted.split.items()} if hosted is not None else {},
                bytes=opt.qk_clip.collective_bytes)


TP_CASES = {  # name: (world, tp, kv, stage, layout)
    "tp2-gqa-z1": (2, 2, 2, 1, "owned"),
    "tp2-mha-z0": (2, 2, 4, 0, "owned"),
    "tp2-dp2-mha-z1-mixed": (4, 2, 4, 1, "mixed"),
}


def _tp_reference(kv, tau, dp, stage, tp=2):
    model = TPLM(kv, shards=tp)
    model.load_state_dict(TPLM.full_state(kv))
    return _reference(dp, kv, tau, stage, 1, "tp", model=model)


@pytest.mark.dist
@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_runs_equal_the_reference(case):
    """Megatron-style TP: each TP rank records its own heads (reduced over its DP group only) and
    scales its own shard's rows after the hosted update; the whole matrices equal the single-process
    Muon + AdamW + published clip bit for bit, with heads clipping on most steps (each TP rank's
    heads on at least two) and with a threshold that never clips."""
    world, tp, kv, stage, layout = TP_CASES[case]
    dp = world // tp
    for tau in (LOW_TAU, HIGH_TAU) if case == "tp2-gqa-z1" else (LOW_TAU,):
        res = run_distributed(_tp_worker, world, tp, kv, tau, stage, layout)
        ref, ref_clipped = _tp_reference(kv, tau, dp, stage)
        for r in res:
            assert_bits(max_abs_diff(r["params"], ref), 0.0, f"{case} tau={tau}: differs from Muon + AdamW + clip")
            assert r["bytes"] == 4 * 4 // tp  # this rank's heads only: one fp32 per head
        # the TP-split q/k shards went through a hosted runtime (TP group; the mixed layout: the grid)
        kinds = {n: {r["split"][n] for r in res if n in r["split"]}
                 for n in ("attn.q_proj.weight", "attn.k_proj.weight")}
        assert all(kinds.values()), kinds
        if layout == "mixed":  # q_proj's TP shards cut into DP pieces, each piece scaled by its rank
            assert kinds["attn.q_proj.weight"] == {"GridSplit"}, kinds
        # each TP rank counts its own heads; together they are the reference's count
        per_tp = {r["tp_rank"]: r["stats"] for r in res}
        assert [sum(c) for c in zip(*per_tp.values())] == ref_clipped
        if tau == LOW_TAU:
            assert sum(c > 0 for c in ref_clipped) >= STEPS - 1, ref_clipped
            assert all(sum(c > 0 for c in counts) >= 2 for counts in per_tp.values()), per_tp  # both ranks' rows
            assert max_abs_diff(ref, _tp_reference(kv, float("inf"), dp, stage)[0]) > 1e-3
        else:
            assert ref_clipped == [0] * STEPS
            assert_bits(max_abs_diff(ref, _tp_reference(kv, float("inf"), dp, stage)[0]), 0.0)


def _tp_refusal_worker(rank, world):
    """q_proj tagged as split on its columns (partition_dim 1): its TP shard is not its heads' rows."""
    import canzona_ds  # noqa: F401
    import deepspeed
    from canzona_testkit import megatron_standin as ms

    ms.initialize_model_parallel(world)
    model = TPLM(2)
    model.attn.q_proj.weight.partition_dim = 1
    try:
        deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                             config=ds_config(1, micro=MICRO, params=_params(1.0), stage=1), mpu=ms.mpu)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_tensor_parallel_q_k_not_split_by_heads_is_refused():
    for err in run_distributed(_tp_refusal_worker, 2):
        assert err is not None and "'attn.q_proj.weight' is tensor-parallel (partition_dim=1" in err, err


def _autotp_worker(rank, world, kv, tau):
    """The project's model (LM) under DeepSpeed AutoTP (tensor_parallel.autotp_size = world, DP 1,
    ZeRO-1): this TP rank's clipped heads and largest logit per step, and the whole q/k matrices."""
    import torch.distributed as dist

    import canzona_ds  # noqa: F401
    import deepspeed
    from canzona_ds.integration.runtime_info import canzona_optimizer

    torch.set_num_threads(test_threads())
    model = LM(kv)
    cfg = ds_config(1, micro=MICRO, params=_params(tau), stage=1, tensor_parallel={"autotp_size": world})
    del cfg["train_batch_size"]  # (DeepSpeed checks it against the world size under AutoTP)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=cfg)
    opt = canzona_optimizer(engine)
    stats, stock = [], opt.qk_clip.row_scales

    def row_scales(step, device=None):
        out = stock(step, device)
        stats.append((opt.qk_clip.stats.clipped_heads, opt.qk_clip.stats.max_logit))
        return out

    opt.qk_clip.row_scales = row_scales
    for x, y in _data(STEPS, 1, 1):
        engine.backward(engine(x, y))
        engine.step()
    qk = {n: p.detach().clone() for n, p in engine.module.named_parameters() if "q_proj" in n or "k_proj" in n}
    shards: list = [None] * world
    dist.all_gather_object(shards, qk, group=opt.groups.tp_group)
    return dict(stats=stats, heads=[l.num_heads for l in opt.qk_clip.layers], tp_rows=opt.qk_clip.layers[0].tp_rows,
                qk={n: torch.cat([s[n] for s in shards]).numpy() for n in qk})


@pytest.mark.dist
def test_autotp_tracks_the_reference():
    """DeepSpeed AutoTP (tensor_parallel.autotp_size 2, 2 ranks = DP 1 x TP 2, ZeRO-1) on the
    project's Llama-style model: AutoTP splits q_proj / k_proj on their rows and divides the
    attention's head counts, so each TP rank records its own 2 heads (read from the rows it
    holds) and scales its own shard.  Against the single-process reference: the clipped heads
    (summed over the TP ranks) equal every step, the first step's largest logit is the
    reference's, and the clipped q/k matrices agree to rounding.  Not bit for bit: AutoTP's
    row-parallel o_proj / down_proj all-reduce sums in another order than one GEMM, and bf16
    Newton-Schulz amplifies that (the bit-for-bit TP checks are the Megatron-style ones above)."""
    res = run_distributed(_autotp_worker, 2, 2, LOW_TAU)
    ref, ref_clipped = _reference(1, 2, LOW_TAU, 1, 1)
    assert all(r["heads"] == [2, 2] for r in res), [r["heads"] for r in res]  # 4 heads over 2 TP ranks
    assert res[1]["tp_rows"]["lm.model.layers.0.self_attn.q_proj.weight"] == (16, 32)  # rank 1: heads 2-3
    assert [a[0] + b[0] for a, b in zip(res[0]["stats"], res[1]["stats"])] == ref_clipped
    assert sum(c > 0 for c in ref_clipped) >= STEPS - 1, ref_clipped
    # the clip moves these matrices by up to 0.72 (clipped vs unclipped reference); the run is
    # 6e-4 from the clipped reference (measured; the bf16 Newton-Schulz drift of a 2-rank sum order)
    unclipped, _ = _reference(1, 2, float("inf"), 1, 1)
    for n, w in res[0]["qk"].items():
        assert float(abs(w - ref[n]).max()) < 2e-3, n
        assert float(abs(w - unclipped[n]).max()) > 0.1, n
    assert res[0]["qk"].keys() == res[1]["qk"].keys() and len(res[0]["qk"]) == 4


# ---------------------------------------------------------------------------- DeepSpeed MoE
class DSMoELM(nn.Module):
    """Embedding -> attention (plain: TPAttention without a TP group) -> a DeepSpeed MoE layer
    (``deepspeed.moe.layer.MoE``, 2 bias-free experts; ``ep_size`` 1: every rank holds both, the
    expert group is the DP group; top-1, no token dropped) -> RMS norm -> lm_head; loss + 0.01 x the
    gate's load-balancing loss.  The attention is dense, as in every DeepSpeed MoE model."""

    def __init__(self, kv: int, ep_size: int = 1) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.attn = TPAttention(4, kv)
        # (every expert is a copy of this one, at any ep_size; nothing below draws per expert, so a
        # rank's expert at ep_size 2 starts as the ep_size-1 model's expert of the same number)
        expert = nn.Sequential(nn.Linear(HIDDEN, 48, bias=False), nn.GELU(), nn.Linear(48, HIDDEN, bias=False))
        self.moe = MoE(hidden_size=HIDDEN, expert=expert, num_experts=2, ep_size=ep_size, k=1, capacity_factor=2.0,
                       eval_capacity_factor=2.0, min_capacity=0, drop_tokens=True, use_rts=False)
        self.norm = nn.Parameter(torch.ones(HIDDEN))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            for n, p in self.named_parameters():
                if "proj" in n:
                    p.normal_(0.0, 0.3)  # (logits ~1-4: heads clip at LOW_TAU)

    def forward(self, x, y):
        h = self.embed(x)
        h = h + self.attn(h)
        out, l_aux, _ = self.moe(h)
        return self.head(h + out, y, l_aux)

    def head(self, h, y, l_aux):
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return F.cross_entropy(self.lm_head(h).flatten(0, 1), y.flatten()) + 0.01 * l_aux

    attention_modules = TPLM.attention_modules
    q_k_scale = TPLM.q_k_scale


class DSMoELMEP2(DSMoELM):
    """DSMoELM at ep_size 2: at DP = 2 each rank holds one of the two experts (its local expert 0
    is global expert ``rank``), tokens reach it through DeepSpeed's all-to-all."""

    def __init__(self, kv: int) -> None:
        super().__init__(kv, ep_size=2)


MODELS["dsmoe"] = DSMoELM
MODELS["dsmoe-ep2"] = DSMoELMEP2


def _ep_grads(model, x, y, dp, micro, gas, stage):
    """ZeRO's averaged gradient of the ep_size-1 reference model (both experts) for the ep_size =
    ``dp`` run: every DP rank's forward in turn up to the MoE layer; its gate (the layer's own
    ``TopKGate``) and DeepSpeed's slot encoding; then the all-to-all written out -- EP rank k
    receives expert k's slots of every rank in rank order and runs its expert once over all of
    them, as the rank holding it does (canzona_testkit/moe.reference_run, the same arithmetic) --
    and back; every rank's loss; one backward of their sum (a dense weight gets one term per
    rank, an expert one term); each gradient / dp (ZeRO's average: a sum of two terms, exact)."""
    from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode

    assert gas == 1 and stage == 1 and dp == 2
    moe = model.moe.deepspeed_moe
    E = len(moe.experts.deepspeed_experts)
    local = E // dp
    model.zero_grad(set_to_none=True)
    x, y = x[0], y[0]
    routed = []
    for r in range(dp):
        h = model.embed(x[r * micro:(r + 1) * micro])
        h = h + model.attn(h)
        flat = h.reshape(-1, HIDDEN)
        l_aux, C, _, indices, locations, gates, _ = moe.gate(flat, None, True, False)
        slots = _route_slots(indices, locations, E, int(C))
        routed.append((h, l_aux, int(C), slots, gates, _sparse_encode(flat, slots, E, int(C))))
    back = [[None] * dp for _ in range(dp)]
    for k in range(dp):  # EP rank k
        received = torch.cat([r[5][k * local:(k + 1) * local] for r in routed]).reshape(dp, local, -1, HIDDEN)
        out = torch.cat([moe.experts.deepspeed_experts[k * local + j](chunk)
                         for j, chunk in enumerate(received.chunk(local, dim=1))], dim=1)
        out = out.reshape(dp * local, -1, HIDDEN)
        for r in range(dp):
            back[r][k] = out[r * local:(r + 1) * local]
    total = None
    for r, (h, l_aux, C, slots, gates, _) in enumerate(routed):
        combined = _sparse_decode(torch.cat(back[r]).view(E * C, HIDDEN), slots, gates, h.shape[0] * h.shape[1])
        loss = model.head(h + combined.reshape(h.shape), y[r * micro:(r + 1) * micro], l_aux)
        total = loss if total is None else total + loss
    total.backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) / dp for n, p in model.named_parameters()}


def _dsmoe_reference_worker(rank, world, kv, tau, ep_size=1):
    """The reference in a 1-rank world (DeepSpeed MoE's forward needs its expert group, here of
    one rank: its all-to-alls are copies), each DP rank's micro-batch run in turn as _reference does;
    ``ep_size`` 2: the all-to-all between the DP ranks written out (_ep_grads)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # (deepspeed.comm over this 1-rank world)

    def run(t):
        model = DSMoELM(kv)
        model.moe.set_deepspeed_parallelism()
        return _reference(2, kv, t, 1, 1, "dsmoe", model=model, grads_fn=grads_fn)

    grads_fn = _ep_grads if ep_size > 1 else reference_grads

    params, clipped = run(tau)
    model = DSMoELM(kv)  # the first step's gradients, with this ep_size's arithmetic
    model.moe.set_deepspeed_parallelism()
    x, y = _data(1, 2, 1)[0]
    grads = grads_fn(model, [x], [y], 2, MICRO, 1, 1)
    return params, clipped, run(float("inf"))[0], {n: g.numpy() for n, g in grads.items() if "deepspeed_experts" in n}


@pytest.mark.dist
@pytest.mark.parametrize("ep_size", [1, 2])
def test_deepspeed_moe_runs_equal_the_reference(ep_size):
    """DeepSpeed MoE (expert groups), ZeRO-1, DP=2, ep_size 1 (each rank both experts) and 2 (one
    expert per rank, tokens exchanged by all-to-all, expert-DP groups of one rank): the dense
    attention's maxima reduced over the DP group, its q/k rows clipped as without MoE; bit for bit
    against the reference, every rank's experts included, and the experts' first gradients too
    (at ep_size 2 they differ by ulps from the ep_size-1 arithmetic, which the weights alone would
    not show: Muon's Newton-Schulz runs in bf16)."""
    res = run_distributed(_worker, 2, 2, LOW_TAU, 1, 1, "dsmoe" if ep_size == 1 else "dsmoe-ep2")
    ref, ref_clipped, unclipped, ref_grads = run_distributed(_dsmoe_reference_worker, 1, 2, LOW_TAU, ep_size)[0]
    # the experts' first gradients, bit for bit (the final weights alone could hide an fp32 ulp:
    # Muon's Newton-Schulz runs in bf16); every expert matrix is owned by one rank
    owned = {n: g for r in res for n, g in r["expert_grads"].items()}
    assert_bits(max_abs_diff(owned, ref_grads), 0.0)
    assert owned.keys() == ref_grads.keys()
    experts = [{n.split("deepspeed_experts.")[1].split(".")[0] for n in r["params"] if "deepspeed_experts" in n}
               for r in res]
    assert experts == ([{"0", "1"}] * 2 if ep_size == 1 else [{"0"}, {"1"}]), experts
    for r in res:
        assert_bits(max_abs_diff(r["params"], ref), 0.0, "DeepSpeed MoE: differs from Muon + AdamW + clip")
        assert [c for c, _ in r["stats"]] == ref_clipped
    assert sum(c > 0 for c in ref_clipped) >= STEPS - 1, ref_clipped
    assert max_abs_diff(ref, unclipped) > 1e-3
