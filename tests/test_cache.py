"""The hybrid cache's KDA states: one tensor for all layers (the layers' states are views of it), and
the rollback after a verification pass, all layers in two gathers, against the layer-by-layer copy."""

from __future__ import annotations

import pytest
import torch

from solo.checkpoint.synthetic import synthetic_config
from solo.model.cache import HybridCache, KDAHistories, KDAHistory


def small_config():
    """Five layers of the published layout (KDA and MLA), narrow: only the cache's shapes matter here."""
    return synthetic_config(num_layers=5, num_experts=16, vocab_size=64, linear_num_heads=2, linear_head_dim=16)


def test_layer_states_are_views_of_the_packed_tensors() -> None:
    cache = HybridCache(small_config(), 16, "cpu", torch.float32)
    assert len(cache.kda) == cache.kda_recurrent.shape[0] > 1
    for i, state in enumerate(cache.kda.values()):
        value = torch.randn(())
        state.recurrent[0, 1, 2] = value
        state.conv[3, 1] = value + 1
        assert cache.kda_recurrent[i, 0, 1, 2] == value and cache.kda_conv[i, 3, 1] == value + 1
    cache.reset()
    assert not cache.kda_recurrent.any() and not cache.kda_conv.any()


def test_the_packed_rollback_equals_the_layer_by_layer_copy() -> None:
    config = small_config()
    for keep in range(1, 5):
        packed, plain = (HybridCache(config, 16, "cpu", torch.float32) for _ in range(2))
        history = packed.new_history(4)
        assert isinstance(history, KDAHistories) and list(history) == packed.kda_layers
        history.states.copy_(torch.randn_like(history.states))
        history.window.copy_(torch.randn_like(history.window))
        start = (torch.randn_like(packed.kda_recurrent), torch.randn_like(packed.kda_conv))
        for cache in (packed, plain):
            cache.kda_recurrent.copy_(start[0])
            cache.kda_conv.copy_(start[1])
        # a plain dict of the same layers' histories takes the layer-by-layer path
        loose = {layer: KDAHistory(h.states.clone(), h.window.clone()) for layer, h in history.items()}
        packed.rollback_kda(history, torch.tensor([keep]))
        plain.rollback_kda(loose, torch.tensor([keep]))
        assert torch.equal(packed.kda_recurrent, plain.kda_recurrent)
        assert torch.equal(packed.kda_conv, plain.kda_conv)
        for i, layer in enumerate(packed.kda_layers):
            assert torch.equal(packed.kda[layer].recurrent, history[layer].states[keep - 1])
            width = packed.kda_conv.shape[2]
            assert torch.equal(packed.kda_conv[i], history.window[i, :, keep : keep + width])


def test_a_lazy_rollback_settles_to_what_the_copy_gives() -> None:
    """The lazy rollback leaves the states in the cache's own history (kda_source points at the slot);
    settle_kda brings them back: the same states and conv windows as the copying rollback."""
    config = small_config()
    for keep in range(1, 5):
        lazy, eager = (HybridCache(config, 16, "cpu", torch.float32, verify_window=4) for _ in range(2))
        for cache in (lazy, eager):
            assert cache.verification is not None and cache.verification.states.shape[1] == 4
        buffers = [(c.kda_recurrent, c.kda_conv, c.verification.states, c.verification.window) for c in (lazy, eager)]
        start = [torch.randn_like(t) for t in buffers[0]]
        for tensors in buffers:
            for dst, src in zip(tensors, start, strict=True):
                dst.copy_(src)
        lazy.rollback_kda(lazy.verification, torch.tensor([keep]), lazy=True)
        eager.rollback_kda(eager.verification, torch.tensor([keep]))
        assert int(lazy.kda_source) == keep and lazy.kda_lazy and int(eager.kda_source) == 0
        assert torch.equal(lazy.kda_recurrent, start[0])  # not copied: the states stay in the history
        assert torch.equal(lazy.kda_conv, eager.kda_conv)  # the conv windows are gathered either way
        lazy.settle_kda()
        assert int(lazy.kda_source) == 0 and not lazy.kda_lazy
        assert torch.equal(lazy.kda_recurrent, eager.kda_recurrent)
        lazy.settle_kda()  # nothing pending: a no-op
        assert torch.equal(lazy.kda_recurrent, eager.kda_recurrent)


def test_an_eager_rollback_after_a_lazy_one_points_back_at_the_cache() -> None:
    config = small_config()
    cache = HybridCache(config, 16, "cpu", torch.float32, verify_window=4)
    for t in (cache.verification.states, cache.verification.window):
        t.copy_(torch.randn_like(t))
    cache.rollback_kda(cache.verification, torch.tensor([3]), lazy=True)
    other = cache.new_history(4)
    other.states.copy_(torch.randn_like(other.states))
    cache.rollback_kda(other, torch.tensor([2]))
    assert int(cache.kda_source) == 0 and not cache.kda_lazy
    assert torch.equal(cache.kda_recurrent, other.states[:, 1])
    cache.rollback_kda(cache.verification, torch.tensor([4]), lazy=True)
    cache.reset()
    assert int(cache.kda_source) == 0 and not cache.kda_lazy and not cache.kda_recurrent.any()


def test_a_lazy_rollback_from_another_history_is_refused() -> None:
    config = small_config()
    cache = HybridCache(config, 16, "cpu", torch.float32)
    assert cache.verification is None
    with pytest.raises(ValueError, match="verify_window"):
        cache.rollback_kda(cache.new_history(4), torch.tensor([1]), lazy=True)
