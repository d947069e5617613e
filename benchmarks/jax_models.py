"""Pure-JAX twins of the benchmark models, the baseline that ``bench_step.py`` measures xshard against.

Each model here computes exactly what its PyTorch original computes, written directly in
``jax.numpy``/``jax.lax`` (no flax, no optax), so a step-time ratio compares xshard's program with the
program a JAX user would write by hand:

- ``MLP``: the benchmark MLP of ``bench_step.py`` (Linear -> ReLU blocks, cross-entropy).
- GPT: ``xshard.models.GPT`` (pre-LN blocks, causal attention, exact-erf GELU, tied embeddings,
  cross-entropy with ``ignore_index``).
- ``adamw_update``: ``torch.optim.AdamW`` (defaults: betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2,
  no amsgrad), in the same order of operations as PyTorch's single-tensor implementation.

Parameters are dicts keyed by the torch ``state_dict`` names (``params_from_torch``), so both sides start
from identical weights; tied weights appear once (``lm_head.weight`` is ``wte.weight``).

Example:
    >>> params = params_from_torch(gpt, sharding)                    # doctest: +SKIP
    >>> step = make_train_step(gpt_loss_fn(gpt.cfg), AdamW(lr=1e-3))  # doctest: +SKIP
    >>> state = adamw_init(params)                                    # doctest: +SKIP
    >>> params, state, loss = step(params, state, idx, targets, 1)    # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch

# -- weights ---------------------------------------------------------------------------------------

def params_from_torch(model: torch.nn.Module, sharding=None) -> dict:
    """The model's parameters as float32 ``jax.Array``s keyed by their ``state_dict`` names.

    Args:
        model: a CPU torch module (read before it is moved to any device).
        sharding: where to put the arrays (``jax.sharding.Sharding``); default: JAX's default device.

    Returns:
        A dict name -> ``jax.Array``; tied parameters appear once, under the name they are tied to.
    """
    params = {}
    for name, p in model.named_parameters():  # named_parameters() lists a tied parameter once
        value = np.array(p.detach().cpu().numpy(), dtype=np.float32)
        params[name] = jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)
    return params


# -- AdamW, as torch.optim.AdamW computes it --------------------------------------------------------


@dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW's hyper-parameters (its defaults)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-2


def adamw_init(params: dict) -> dict:
    """Zeroed first and second moments, like the state torch.optim.AdamW creates on its first step."""
    zeros = lambda p: jnp.zeros_like(p)  # noqa: E731
    return {"exp_avg": jax.tree.map(zeros, params), "exp_avg_sq": jax.tree.map(zeros, params)}


def adamw_update(opt: AdamW, params: dict, grads: dict, state: dict, step_size, bias_correction2_sqrt):
    """One AdamW step, in the operation order of torch/optim/adamw.py (single-tensor, decoupled decay).

    PyTorch computes the bias corrections on the host in double precision from its CPU step counter
    and passes them to the kernels as scalars; ``host_scalars`` does the same, and the two values enter
    the program as traced scalars (no recompile per step).
    """

    def one(p, g, m, v):
        p = p * (1 - opt.lr * opt.weight_decay)             # param.mul_(1 - lr * weight_decay)
        m = m + (g - m) * (1 - opt.beta1)                   # exp_avg.lerp_(grad, 1 - beta1)
        v = v * opt.beta2 + (g * g) * (1 - opt.beta2)       # exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
        denom = jnp.sqrt(v) / bias_correction2_sqrt + opt.eps
        p = p - step_size * (m / denom)                     # param.addcdiv_(exp_avg, denom, -step_size)
        return p, m, v

    new_p, new_m, new_v = {}, {}, {}
    for name in params:
        new_p[name], new_m[name], new_v[name] = one(
            params[name], grads[name], state["exp_avg"][name], state["exp_avg_sq"][name])
    return new_p, {"exp_avg": new_m, "exp_avg_sq": new_v}


def host_scalars(opt: AdamW, step: int):
    """``(step_size, bias_correction2_sqrt)`` for 1-based ``step``, as float32 scalars."""
    bias_correction1 = 1 - opt.beta1 ** step
    bias_correction2 = 1 - opt.beta2 ** step
    return np.float32(opt.lr / bias_correction1), np.float32(bias_correction2 ** 0.5)


def make_train_step(loss_fn, opt: AdamW = AdamW(), batch_shardings=None):
    """A training step ``(params, opt_state, x, y, step) -> (params, opt_state, loss)``.

    Forward and backward are one ``jax.value_and_grad``, followed by the AdamW update, all in one
    ``jax.jit``; parameters and optimizer state are donated, so the update reuses their buffers.
    ``step`` is the 1-based step count (a Python int).

    Args:
        loss_fn: ``(params, x, y) -> scalar loss``.
        opt: AdamW hyper-parameters.
        batch_shardings: optional ``(x_sharding, y_sharding)`` to constrain the batch (data parallel).
    """

    def train_step(params, state, x, y, step_size, bias_correction2_sqrt):
        if batch_shardings is not None:
            x = jax.lax.with_sharding_constraint(x, batch_shardings[0])
            y = jax.lax.with_sharding_constraint(y, batch_shardings[1])
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params, state = adamw_update(opt, params, grads, state, step_size, bias_correction2_sqrt)
        return params, state, loss

    jitted = jax.jit(train_step, donate_argnums=(0, 1))

    def step_fn(params, state, x, y, step: int):
        return jitted(params, state, x, y, *host_scalars(opt, step))

    step_fn.jitted = jitted
    return step_fn


class TrainLoop:
    """``make_train_step`` over placed parameters, optimizer state and batches: ``step()`` runs the
    next batch; the benchmarks time it (``bench_step.py``, ``bench_compile.py``)."""

    def __init__(self, params: dict, state: dict, batches: list, loss_fn, opt: AdamW,
                 batch_shardings=None):
        self.params, self.state, self.batches, self.opt = params, state, batches, opt
        self.fn = make_train_step(loss_fn, opt, batch_shardings)
        self.next = 0
        self._loss_arrays = []

    def step(self):
        x, y = self.batches[self.next]
        self.next += 1
        self.params, self.state, loss = self.fn(self.params, self.state, x, y, self.next)
        self._loss_arrays.append(loss)

    def block(self):
        """Waits for every step dispatched so far."""
        jax.block_until_ready((self.params, self.state, self._loss_arrays[-1:]))

    def losses(self):
        return [float(a) for a in self._loss_arrays]


# -- layers ----------------------------------------------------------------------------------------


def linear(params: dict, prefix: str, x, bias: bool = True):
    """``nn.Linear``: ``x @ W.T + b`` with the torch weight layout (out_features, in_features)."""
    y = jnp.matmul(x, params[f"{prefix}.weight"].T)
    if bias:
        y = y + params[f"{prefix}.bias"]
    return y


def layer_norm(params: dict, prefix: str, x, bias: bool = True, eps: float = 1e-5):
    """``nn.LayerNorm`` over the last dimension (biased variance, eps inside the square root)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * params[f"{prefix}.weight"]
    if bias:
        y = y + params[f"{prefix}.bias"]
    return y


def gelu(x):
    """``F.gelu`` default: the exact form ``x * Phi(x)`` with erf."""
    return x * 0.5 * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))


def cross_entropy(logits, targets, ignore_index: int = -100):
    """``F.cross_entropy`` with mean reduction over the targets that are not ``ignore_index``."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    valid = targets != ignore_index
    safe = jnp.where(valid, targets, 0)
    picked = jnp.take_along_axis(logp, safe[:, None], axis=-1)[:, 0]
    nll = jnp.where(valid, -picked, 0.0)
    return jnp.sum(nll) / jnp.sum(valid).astype(logits.dtype)


# -- the models ------------------------------------------------------------------------------------


def _constrainer(activation_sharding):
    """``h -> h`` laid out as ``activation_sharding`` (a jax Sharding), or the identity for None.

    JAX's FSDP idiom: with the activations pinned to the batch sharding, the partitioner can only
    gather each layer's weights where the layer runs (FSDP); left free, it may instead keep the
    weights where they are and move the activations.
    """
    if activation_sharding is None:
        return lambda h: h
    return lambda h: jax.lax.with_sharding_constraint(h, activation_sharding)


def mlp_loss_fn(n_linear: int, activation_sharding=None):
    """Loss of the benchmark MLP: ``n_linear`` Linear layers named ``net.{2i}``, ReLU between;
    each layer's output constrained to ``activation_sharding`` when one is given."""
    constrain = _constrainer(activation_sharding)

    def loss_fn(params, x, y):
        h = x
        for i in range(n_linear):
            h = constrain(linear(params, f"net.{2 * i}", h))
            if i < n_linear - 1:
                h = jax.nn.relu(h)
        return cross_entropy(h, y)

    return loss_fn


def _attention(params: dict, prefix: str, x, n_head: int, bias: bool):
    b, t, c = x.shape
    hd = c // n_head
    qkv = linear(params, f"{prefix}.qkv", x, bias)
    q, k, v = jnp.split(qkv, 3, axis=2)
    q, k, v = (z.reshape(b, t, n_head, hd).transpose(0, 2, 1, 3) for z in (q, k, v))
    # F.scaled_dot_product_attention(is_causal=True): softmax(q k^T / sqrt(hd) + causal mask) v
    scores = jnp.matmul(q, k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd))
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    y = jnp.matmul(jax.nn.softmax(scores, axis=-1), v)
    y = y.transpose(0, 2, 1, 3).reshape(b, t, c)
    return linear(params, f"{prefix}.proj", y, bias)


def gpt_loss_fn(cfg, ignore_index: int = -100, activation_sharding=None):
    """Loss of ``xshard.models.GPT(cfg)``: ``(params, idx, targets) -> mean cross-entropy``; the
    residual stream constrained to ``activation_sharding`` at each block when one is given."""
    bias = cfg.bias
    constrain = _constrainer(activation_sharding)

    def loss_fn(params, idx, targets):
        b, t = idx.shape
        wte = params["wte.weight"]
        x = constrain(jnp.take(wte, idx, axis=0) + params["wpe.weight"][:t])
        for i in range(cfg.n_layer):
            p = f"blocks.{i}"
            x = constrain(x + _attention(params, f"{p}.attn",
                                         layer_norm(params, f"{p}.ln_1", x, bias), cfg.n_head, bias))
            h = layer_norm(params, f"{p}.ln_2", x, bias)
            h = linear(params, f"{p}.mlp.proj", gelu(linear(params, f"{p}.mlp.fc", h, bias)), bias)
            x = constrain(x + h)
        x = layer_norm(params, "ln_f", x, bias)
        logits = constrain(jnp.matmul(x, wte.T))  # lm_head tied to wte
        return cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1), ignore_index)

    return loss_fn
