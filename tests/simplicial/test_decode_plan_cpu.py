"""The decoding step's plan (altattn/simplicial/kvcache.py: `_Step`, `_call_key`) without a GPU:
its key tells apart every call `_setup` would judge differently, and its launches are the general
path's (the same Kernels, each argument the same tensor, descriptor or value), recorded on CPU
tensors with the setup a CUDA call would have (no kernel runs)."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from altattn import registry
from altattn.simplicial import attention_with_kvcache, kvcache
from kernels_triton import launch

B, HQ, HK, D = 4, 128, 1, 128


def _inputs(T: int, w1: int, w2: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def bf16(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    q = bf16(B, T, HQ, D)
    caches = [bf16(B, w + T - 1, HK, D) for w in (w1, w2, w1, w2)]
    new = [bf16(B, T, HK, D) for _ in range(4)]
    lens = torch.tensor([40, 7, 600, 129], dtype=torch.int32)
    return q, caches, new, lens


def test_call_key_tells_apart_what_setup_reads():
    q, caches, new, lens = _inputs(1, 32, 512)
    args = dict(q=q, caches=caches, seqlens=lens, new=new, w1=32, w2=512, sm_scale=None,
                variant="auto", form="trilinear")
    base = kvcache._call_key(**args)
    same = kvcache._call_key(**dict(args, q=q.clone(), caches=[c.clone() for c in caches]))
    assert same == base and hash(same) == hash(base)
    changed = [dict(q=q.float()), dict(q=q[:, :, :64]), dict(seqlens=lens.long()),
               dict(seqlens=lens[:2]), dict(seqlens=0), dict(w1=True), dict(w1=31),
               dict(w2=511), dict(sm_scale=0.1), dict(variant="tlx_ws_kv"), dict(form="det"),
               dict(new=[None] * 4), dict(new=[None, *new[1:]]),
               dict(new=[*new[:3], new[3].to("meta")]),
               dict(new=[*new[:3], torch.nn.Parameter(new[3])])]
    for i in range(4):
        changed.append(dict(caches=[c[:, :-1] if j == i else c for j, c in enumerate(caches)]))
        changed.append(dict(caches=[c.half() if j == i else c for j, c in enumerate(caches)]))
    keys = [kvcache._call_key(**dict(args, **c)) for c in changed]
    assert base not in keys and len(set(keys)) == len(keys)
    with pytest.raises(AttributeError):
        kvcache._call_key(**dict(args, caches=[caches[0].tolist(), *caches[1:]]))
    with pytest.raises(TypeError):
        hash(kvcache._call_key(**dict(args, sm_scale=[0.1])))


def _normalized(calls, known: dict):
    """Recorded Kernel calls with every tensor named: an input by its name, any other by the
    order its storage first appears in (the outputs and the shares' scratch); a descriptor by
    its base's name and its layout."""
    seen = dict(known)

    def name(t):
        return seen.setdefault(t.data_ptr(), f"new{len(seen) - len(known)}")

    def norm(a):
        if isinstance(a, TensorDescriptor):
            return ("desc", name(a.base), list(a.shape), list(a.strides), list(a.block_shape))
        if isinstance(a, torch.Tensor):
            return ("tensor", name(a), a.dtype)
        return a

    return [(kernel, [norm(a) for a in args], {k: norm(v) for k, v in kw.items()})
            for kernel, args, kw in calls]


@pytest.mark.parametrize("w1,w2", [(32, 512), (200, 32)])
@pytest.mark.parametrize("n_split", [1, 3])
@pytest.mark.parametrize("appended", [True, False])
@pytest.mark.parametrize("through", ["step", "call"])
def test_step_launches_what_the_general_path_launches(monkeypatch, w1, w2, n_split, appended,
                                                      through):
    """through "step": the plan called itself; "call": `attention_with_kvcache` taking it
    (q remembered as a CUDA call's would be, its second call the plan's lookup)."""
    T = 1
    q, caches, new, lens = _inputs(T, w1, w2)
    if not appended:
        new = [None] * 4
    variant = registry.get_family("simplicial").variant("tlx_pipelined_kv", "fwd")
    real_setup = kvcache._setup

    def cuda_setup(*args):  # what a CUDA call's setup holds (`_setup` on CPU: no variant)
        s = real_setup(*args)
        return replace(s, variant=variant, n_split=n_split, cache_mode=True,
                       launch_spec=replace(s.spec, N=B * T, varlen=True))

    calls = []
    monkeypatch.setattr(launch.Kernel, "__call__",
                        lambda self, *a, **kw: calls.append((self, a, kw)))
    monkeypatch.setattr(kvcache, "_setup", cuda_setup)
    known = {t.data_ptr(): n for n, t in zip(
        ("q", "k1c", "k2c", "v1c", "v2c", "k1", "k2", "v1", "v2", "lens"),
        (q, *caches, *new, lens)) if t is not None}
    args = (q, *caches, lens, w1, w2)
    kw = dict(zip(("k1", "k2", "v1", "v2"), new)) if appended else {}
    general = attention_with_kvcache(*args, **kw)  # on CPU: the general path, its append
    general_calls = calls[:]                       # by indexing (no kernel)
    calls.clear()
    if appended:
        from kernels_triton.simplicial.decode import append
        append(caches, new, lens)
        general_calls = calls[:] + general_calls
        calls.clear()
    s = cuda_setup(q, *caches, lens, *new, w1, w2, None, "auto", "trilinear")
    assert kvcache._Step.able(s)
    monkeypatch.setattr(kvcache, "_scratch_owner", lambda *sizes: ("stream", *sizes))
    monkeypatch.setattr(kvcache, "_LOCAL", threading.local())
    if through == "step":
        step = kvcache._Step(s, q, caches)
        assert step.takes(q, caches, new, lens)
        planned = step(q, caches, new, lens)
    else:
        monkeypatch.setattr(kvcache, "_PLANS", {})
        monkeypatch.setattr(kvcache, "_remember", lambda q: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: q.get_device())
        attention_with_kvcache(*args, **kw)
        assert [step is not None for _, step in kvcache._PLANS.values()] == [True]
        calls.clear()
        planned = attention_with_kvcache(*args, **kw)
        assert len(kvcache._PLANS) == 1
    assert len(calls) == appended + 1 + (n_split > 1)
    assert _normalized(calls, known) == _normalized(general_calls, known)
    forward = _normalized(calls, known)[appended]
    assert forward[1][:5] == [("tensor", "q", torch.bfloat16), *forward[1][1:5]]
    for a, b in zip(planned, general):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def test_step_refuses_what_it_cannot_read_in_place():
    q, caches, new, lens = _inputs(1, 32, 512)
    s = kvcache._setup(q, *caches, lens, *new, 32, 512, None, "auto", "trilinear")
    variant = registry.get_family("simplicial").variant("tlx_pipelined_kv", "fwd")
    s = replace(s, variant=variant, n_split=2, cache_mode=True,
                launch_spec=replace(s.spec, N=B, varlen=True))
    step = kvcache._Step(s, q, caches)
    assert step.takes(q, caches, new, lens)
    strided = torch.empty(B, 2, HQ, D, dtype=q.dtype)[:, :1]
    assert not step.takes(strided, caches, new, lens)
    assert not step.takes(q, caches, new, torch.empty(B + 1, dtype=torch.int32)[1:])
    strided = torch.empty(B, 2, HK, D, dtype=q.dtype)[:, :1]
    assert not step.takes(q, caches, [*new[:3], strided], lens)
    assert not step.takes(q, [*caches[:3], caches[3][:, 1:]], new, lens)


def test_shares_scratch_is_kept_per_thread_stream_and_size(monkeypatch):
    """The shares' scratch: the thread's last one again for the same owner (device, stream,
    sizes), a new one for another (then kept instead), a new one not kept while a graph is
    captured (owner None), another thread's own."""
    q, caches, new, lens = _inputs(1, 32, 512)
    s = kvcache._setup(q, *caches, lens, *new, 32, 512, None, "auto", "trilinear")
    variant = registry.get_family("simplicial").variant("tlx_pipelined_kv", "fwd")
    step = kvcache._Step(replace(s, variant=variant, n_split=2, cache_mode=True,
                                 launch_spec=replace(s.spec, N=B, varlen=True)), q, caches)
    stream = ["a"]
    monkeypatch.setattr(kvcache, "_scratch_owner",
                        lambda *sizes: None if stream[0] is None else (stream[0], *sizes))
    monkeypatch.setattr(kvcache, "_LOCAL", threading.local())
    out, lse = step._shares(q)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.numel() == 2 * B * HQ * D + 2 * 2 * HQ * B and lse.numel() == 2 * HQ * B
    assert lse.data_ptr() == out.data_ptr() + 2 * 2 * B * HQ * D
    assert step._shares(q)[0] is out
    stream[0] = "b"
    other = step._shares(q)[0]
    assert other is not out and step._shares(q)[0] is other
    stream[0] = None
    assert step._shares(q)[0] is not other and kvcache._LOCAL.scratch[1] is other
    stream[0] = "b"
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(step._shares(q)[0]))
    thread.start()
    thread.join()
    assert elsewhere[0] is not other and step._shares(q)[0] is other


@pytest.mark.parametrize("grad", ["q", "k1", "v2"])
def test_any_input_that_requires_grad_is_refused(grad):
    q, caches, new, lens = (x.double() if isinstance(x, torch.Tensor) else [t.double() for t in x]
                            for x in _inputs(1, 3, 5))
    lens = lens.int()
    kw = dict(zip(("k1", "k2", "v1", "v2"), new))
    if grad == "q":
        q.requires_grad_()
    else:
        kw[grad].requires_grad_()
    with pytest.raises(ValueError, match="forward-only"):
        attention_with_kvcache(q, *caches, lens, 3, 5, **kw)
    with torch.no_grad():
        attention_with_kvcache(q, *caches, lens, 3, 5, **kw)
