"""A Hugging Face transformers attention backend, "kvrecall", that sends every layer's decode
attention to the kvrecall service.

    import kvrecall.hf
    backend = kvrecall.hf.KvRecallBackend(kvrecall.Client(addr), kvrecall.make_policy("retopk"))
    model.set_attn_implementation("kvrecall")   # or from_pretrained(..., attn_implementation="kvrecall")
    with backend:                                # one service session per batch row
        out = model(prompt_ids, past_key_values=DynamicCache(), use_cache=True)   # prefill
        out = model(next_ids, past_key_values=out.past_key_values, use_cache=True)  # decode

Prefill (the first call that reaches a layer): the runner computes its own attention with
PyTorch's SDPA and uploads the layer's keys and values, with the post-RoPE queries the session
needs (CreateSessionResponse.prompt_queries). Every later call is a
decode call: each new token's query, key and value go to the service over the client's one
Decode stream, the batch rows of a layer travelling in one request, and the service's output
replaces local attention. Tensors the attention function sees are query [B, q_heads, n, D] and
key/value [B, kv_heads, S, D] (the model's own cache appended; only the last n positions are
read); it returns [B, n, q_heads, D]. Batches must not be padded (the service cannot know which
positions a pad mask hides), so rows have equal lengths.
"""
import contextvars
import math

import numpy as np
import torch

from kvrecall.client import make_geometry

_ACTIVE = contextvars.ContextVar("kvrecall_backend", default=None)
_TORCH_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
NAME = "kvrecall"


class KvRecallBackend:
    """The sessions of one batch of sequences. Enter it around the forward calls of one
    generation; leaving it closes the sessions."""

    def __init__(self, client, policy=None, label="transformers"):
        self.client = client
        self.policy = policy
        self.label = label
        self.sessions = None
        self._prefilled = set()
        self._token = None

    def __enter__(self):
        if self._token is not None:
            raise RuntimeError("KvRecallBackend is already active")
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.reset(self._token)
        self._token = None
        self.close_sessions()

    def close_sessions(self):
        for s in self.sessions or []:
            s.close()
        self.sessions, self._prefilled = None, set()

    def _open(self, module, query, key, scaling):
        layers = module.config.num_hidden_layers
        g = make_geometry(layers, query.shape[1], key.shape[1], query.shape[-1],
                          _TORCH_DTYPES[query.dtype], softmax_scale=float(scaling))
        self.sessions = [self.client.create_session(g, self.policy, f"{self.label} row {b}")
                         for b in range(query.shape[0])]

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
        layer = module.layer_idx
        scaling = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        if self.sessions is None:
            self._open(module, query, key, scaling)
        if len(self.sessions) != query.shape[0]:
            raise ValueError(f"batch of {query.shape[0]} rows in a backend holding "
                             f"{len(self.sessions)} sessions")
        if layer not in self._prefilled:
            return self._prefill(module, layer, query, key, value, attention_mask, scaling,
                                 dropout, **kwargs)
        n = query.shape[2]
        outs = []
        for t in range(n):  # several new tokens: one decode step each, in order (causal)
            steps = [(s, query[b, :, t], key[b, :, key.shape[2] - n + t],
                      value[b, :, key.shape[2] - n + t]) for b, s in enumerate(self.sessions)]
            res = self.client.attend_batch(layer, steps)
            outs.append(np.stack([r.output for r in res]))  # [B, q_heads, D]
        out = torch.from_numpy(np.stack(outs, axis=1))       # [B, n, q_heads, D]
        return out.to(device=query.device, dtype=query.dtype), None

    def _prefill(self, module, layer, query, key, value, attention_mask, scaling, dropout,
                 **kwargs):
        if key.shape[2] != query.shape[2]:
            raise ValueError(f"layer {layer}: the first call must be the whole prompt "
                             f"({query.shape[2]} queries, {key.shape[2]} keys)")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, **kwargs)
        for b, s in enumerate(self.sessions):
            s.prefill({layer: (query[b].transpose(0, 1), key[b].transpose(0, 1),
                               value[b].transpose(0, 1))})
        self._prefilled.add(layer)
        return out


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The function registered as "kvrecall": forwards to the active KvRecallBackend."""
    backend = _ACTIVE.get()
    if backend is None:
        raise RuntimeError('attn_implementation="kvrecall" needs an active KvRecallBackend '
                           "(use `with backend:` around the forward calls)")
    return backend.attention(module, query, key, value, attention_mask, **kwargs)


def register():
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention_forward)


register()


def tinylm_to_llama(npz_path, attn_implementation="sdpa"):
    """A transformers LlamaForCausalLM holding tinylm weights (vocab 256, RMSNorm eps 1e-6,
    rope theta from the .npz config, untied head), float32, on the CPU."""
    import inspect
    from transformers import LlamaConfig, LlamaForCausalLM
    from kvrecall.tinylm import TinyLM
    m = TinyLM(npz_path)
    c = m.config
    kw = dict(vocab_size=256, hidden_size=c["d_model"], intermediate_size=c["ff"],
              num_hidden_layers=c["layers"], num_attention_heads=c["q_heads"],
              num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"], hidden_act="silu",
              max_position_embeddings=1 << 20, rms_norm_eps=1e-6, tie_word_embeddings=False,
              attention_bias=False, mlp_bias=False)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_base"]}
    else:
        kw["rope_theta"] = c["rope_base"]
    config = LlamaConfig(**kw)
    config._attn_implementation = attn_implementation
    model = LlamaForCausalLM(config).float().eval()
    names = {"model.embed_tokens.weight": "emb.weight", "model.norm.weight": "norm.w",
             "lm_head.weight": "head.weight"}
    for i in range(c["layers"]):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        for a, b in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"),
                     ("v", "self_attn.v_proj"), ("o", "self_attn.o_proj"),
                     ("w1", "mlp.gate_proj"), ("w3", "mlp.up_proj"), ("w2", "mlp.down_proj")):
            names[f"{dst}{b}.weight"] = f"{src}{a}.weight"
        names[f"{dst}input_layernorm.weight"] = src + "n1.w"
        names[f"{dst}post_attention_layernorm.weight"] = src + "n2.w"
    state = {k: torch.from_numpy(m.w[v]) for k, v in names.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise ValueError(f"tinylm -> Llama: missing {missing}, unexpected {unexpected}")
    return model, m


def set_attn_implementation(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


@torch.no_grad()
def greedy(model, prompt_ids, new_tokens):
    """Greedy generation with the model's own cache; returns the [B, new_tokens] new ids."""
    from transformers import DynamicCache
    out = model(input_ids=prompt_ids, past_key_values=DynamicCache(), use_cache=True)
    ids = []
    for _ in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        ids.append(nxt)
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(ids, dim=1)
