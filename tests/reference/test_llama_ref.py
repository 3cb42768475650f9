#!/usr/bin/python3
"""Self-check of tests/reference/llama_ref.py against hand-computed facts.

    /usr/bin/python3 tests/reference/test_llama_ref.py        (about 20 s)
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import types
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import llama_ref as L  # noqa: E402

torch.set_num_threads(1)


def tiny(**kw):
    c = dict(L.TINY_DEFAULTS)
    c.update(kw)
    return c


def random_model(seed=0, **kw):
    torch.manual_seed(seed)
    m = L.LlamaRef(tiny(**kw))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            else:
                p.normal_(0, 0.05)
    return m.eval()


class Maths(unittest.TestCase):
    def test_rmsnorm_known_vector(self):
        n = L.RMSNorm(4, eps=1e-5)
        with torch.no_grad():
            n.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
        x = torch.tensor([1.0, 2.0, 3.0, 4.0])
        r = 1.0 / math.sqrt((1 + 4 + 9 + 16) / 4 + 1e-5)  # mean of squares 7.5
        want = torch.tensor([1 * r * 1, 2 * r * 2, 3 * r * 0.5, 4 * r * -1.0])
        torch.testing.assert_close(n(x), want, rtol=1e-6, atol=1e-7)
        # bf16 input: normalised in fp32, cast to bf16, then the weight.
        xb = x.bfloat16()
        got = n(xb)
        self.assertEqual(got.dtype, torch.float32)  # fp32 weight * bf16 promotes
        torch.testing.assert_close(got, n.weight * (x * r).bfloat16().float(), rtol=0, atol=0)
        # eps matters on a small vector
        small = torch.full((4,), 1e-3)
        self.assertAlmostEqual(float(L.RMSNorm(4, 1e-5)(small)[0]),
                               1e-3 / math.sqrt(1e-6 + 1e-5), places=5)

    def test_rotate_half_is_pairwise_rotation(self):
        d = 8
        cfg = L.Cfg(tiny(hidden_size=32, num_attention_heads=4, rope_theta=100.0))
        self.assertEqual(cfg.head_dim, d)
        inv = L.inverse_frequencies(cfg)
        torch.testing.assert_close(inv, torch.tensor([100.0 ** (-2 * i / d) for i in range(d // 2)]))
        x = torch.arange(1.0, d + 1.0).view(1, 1, 1, d)
        for m in (0, 1, 5, 37):
            cos, sin = L.rope_cos_sin(inv, torch.tensor([[m]]))
            got = L.apply_rope(x, cos, sin).view(d)
            want = torch.zeros(d)
            for i in range(d // 2):  # (x_i + j x_{i+d/2}) * e^{j m theta_i}
                z = complex(float(x.view(d)[i]), float(x.view(d)[i + d // 2])) * \
                    complex(math.cos(m * float(inv[i])), math.sin(m * float(inv[i])))
                want[i], want[i + d // 2] = z.real, z.imag
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_llama3_scaling(self):
        base = tiny(hidden_size=64, num_attention_heads=2, rope_theta=500000.0)  # d = 32
        plain = L.inverse_frequencies(L.Cfg(base))
        one = L.inverse_frequencies(L.Cfg(dict(base, rope_scaling={
            "rope_type": "llama3", "factor": 1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})))
        torch.testing.assert_close(one, plain, rtol=1e-6, atol=0)
        # factor 8, context 64: wavelengths < 16 kept, > 64 divided by 8,
        # between: (1-s) f/8 + s f with s = (64/wavelen - 1) / 3.
        rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
        scaled = L.inverse_frequencies(L.Cfg(dict(base, rope_scaling=rs)))
        bands = set()
        for f, g in zip(plain.tolist(), scaled.tolist()):
            w = 2 * math.pi / f
            if w < 16:
                want, band = f, "high"
            elif w > 64:
                want, band = f / 8, "low"
            else:
                s = (64 / w - 1) / 3
                want, band = (1 - s) * f / 8 + s * f, "mid"
            bands.add(band)
            self.assertAlmostEqual(g, want, delta=1e-6 * abs(want))
        self.assertEqual(bands, {"high", "mid", "low"})
        # rope_parameters (transformers 5) names the same thing
        rp = dict(rs, rope_theta=500000.0)
        c5 = dict(base)
        c5.pop("rope_theta")
        torch.testing.assert_close(L.inverse_frequencies(L.Cfg(dict(c5, rope_parameters=rp))), scaled)

    def test_gqa_equals_repeated_full_attention(self):
        g = random_model(1, num_attention_heads=4, num_key_value_heads=2)
        full = L.LlamaRef(tiny(num_attention_heads=4, num_key_value_heads=4)).eval()
        d = g.cfg.head_dim
        sd = {}
        for n, p in g.state_dict().items():
            if n.endswith(("k_proj.weight", "v_proj.weight")):
                # kv head j serves query heads 2j, 2j+1
                p = p.view(2, d, -1).repeat_interleave(2, dim=0).reshape(4 * d, -1)
            sd[n] = p
        full.load_state_dict(sd)
        idx = torch.randint(0, 256, (2, 9))
        torch.testing.assert_close(g(idx), full(idx), rtol=1e-5, atol=1e-6)

    def test_causal(self):
        m = random_model(2)
        a = torch.randint(0, 256, (1, 10))
        b = a.clone()
        b[0, 6:] = (b[0, 6:] + 7) % 256
        torch.testing.assert_close(m(a)[:, :6], m(b)[:, :6])
        self.assertFalse(torch.allclose(m(a)[:, 6:], m(b)[:, 6:]))

    def test_packed_segments_equal_separate_runs(self):
        m = random_model(3, num_key_value_heads=1, head_dim=12)
        s1, s2, s3 = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 4)), torch.randint(0, 256, (1, 3))
        row = torch.cat((s1, s2, s3), dim=1)
        seg = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])
        got = m(row, segment=seg)
        want = torch.cat((m(s1), m(s2), m(s3)), dim=1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # explicit positions give the same
        pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])
        torch.testing.assert_close(m(row, pos, seg), got)
        # rotary attention is relative: a uniform shift of the positions
        # leaves the logits unchanged, a non-uniform one changes them
        torch.testing.assert_close(m(s1, torch.arange(3, 8)[None]), m(s1), rtol=1e-4, atol=1e-5)
        self.assertFalse(torch.allclose(m(s1, torch.tensor([[0, 1, 2, 3, 9]])), m(s1), atol=1e-4))

    def test_kv_cache_generation_matches_recompute(self):
        m = random_model(4, num_key_value_heads=2)
        idx = torch.randint(0, 256, (2, 6))
        torch.testing.assert_close(m.generate(idx, 8), m.generate_uncached(idx, 8), rtol=0, atol=0)
        cache = [{} for _ in m.model.layers]
        step = torch.cat([m(idx[:, :4], cache=cache)[:, -1:], m(idx[:, 4:5], cache=cache),
                          m(idx[:, 5:6], cache=cache)], dim=1)
        torch.testing.assert_close(step, m(idx)[:, 3:], rtol=1e-5, atol=1e-6)

    def test_parameter_names(self):
        names = set(dict(L.LlamaRef(tiny(num_hidden_layers=1, attention_bias=True)).named_parameters()))
        for n in ("q", "k", "v", "o"):
            self.assertIn(f"model.layers.0.self_attn.{n}_proj.bias", names)
        self.assertIn("lm_head.weight", names)
        q = set(dict(L.LlamaRef(tiny(model_type="qwen2", num_hidden_layers=1,
                                     tie_word_embeddings=True)).named_parameters()))
        self.assertIn("model.layers.0.self_attn.q_proj.bias", q)
        self.assertNotIn("model.layers.0.self_attn.o_proj.bias", q)
        self.assertNotIn("lm_head.weight", q)
        plain = set(dict(L.LlamaRef(tiny(num_hidden_layers=1)).named_parameters()))
        self.assertEqual(plain, {
            "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight"})


class Files(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def test_sharded_equals_single(self):
        a, b = os.path.join(self.dir, "a"), os.path.join(self.dir, "b")
        L.make_tiny(a, seed=5, head_dim=24)
        L.make_tiny(b, shards=3, seed=5, head_dim=24)
        self.assertEqual(sorted(os.listdir(b)), ["config.json", "model-00001-of-00003.safetensors",
                                                 "model-00002-of-00003.safetensors",
                                                 "model-00003-of-00003.safetensors",
                                                 "model.safetensors.index.json"])
        ca, ta = L.load_hf_dir(a)
        cb, tb = L.load_hf_dir(b)
        self.assertEqual(ca, cb)
        self.assertEqual(sorted(ta), sorted(tb))
        for n in ta:
            self.assertTrue(torch.equal(ta[n], tb[n]), n)
        with open(os.path.join(b, "model.safetensors.index.json")) as f:
            index = json.load(f)
        self.assertEqual(index["metadata"]["total_size"], sum(t.numel() * 4 for t in ta.values()))
        self.assertEqual(set(index["weight_map"]), set(ta))
        # the weights as made: norms near 1, matrices std ~0.02
        self.assertLess(abs(float(ta["model.norm.weight"].mean()) - 1), 0.05)
        self.assertGreater(float(ta["model.norm.weight"].std()), 0.05)
        self.assertAlmostEqual(float(ta["model.embed_tokens.weight"].std()), 0.02, delta=0.002)
        m = L.load_model(b)
        idx = torch.randint(0, 256, (1, 7))
        torch.testing.assert_close(m(idx), L.load_model(a)(idx), rtol=0, atol=0)

    def test_safetensors_layout_and_dtypes(self):
        for dt, tdt in (("BF16", torch.bfloat16), ("F16", torch.float16)):
            p = os.path.join(self.dir, dt)
            L.make_tiny(p, dtype=dt, tie_word_embeddings=True)
            with open(os.path.join(p, "model.safetensors"), "rb") as f:
                raw = f.read()
            (n,) = struct.unpack("<Q", raw[:8])
            header = json.loads(raw[8:8 + n])
            self.assertEqual(n % 8, 0)
            ends = sorted(e["data_offsets"] for k, e in header.items() if k != "__metadata__")
            self.assertEqual(ends[0][0], 0)
            for (b0, e0), (b1, _) in zip(ends, ends[1:]):
                self.assertEqual(e0, b1)
            self.assertEqual(8 + n + ends[-1][1], len(raw))
            self.assertTrue(all(e["dtype"] == dt for k, e in header.items() if k != "__metadata__"))
            cfg, t = L.load_hf_dir(p)
            self.assertNotIn("lm_head.weight", t)
            self.assertEqual(t["model.norm.weight"].dtype, tdt)
            m = L.load_model(p)
            torch.testing.assert_close(m.model.embed_tokens.weight, t["model.embed_tokens.weight"].float())

    def test_cli_logits_generate(self):
        d = os.path.join(self.dir, "m")
        script = os.path.join(HERE, "llama_ref.py")
        subprocess.run([sys.executable, script, "make", d, "--shards", "2", "--num_key_value_heads", "1",
                        "--rope_scaling", json.dumps({"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32})],
                       check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(d, "config.json")) as f:
            self.assertEqual(json.load(f)["num_key_value_heads"], 1)
        tok = os.path.join(self.dir, "t.json")
        with open(tok, "w") as f:
            json.dump({"tokens": [[3, 4, 5, 6, 7, 8]], "segments": [[0, 0, 0, 1, 1, 1]]}, f)
        out = os.path.join(self.dir, "o.json")
        subprocess.run([sys.executable, script, "logits", d, "--tokens", tok, "--out", out], check=True)
        with open(out) as f:
            got = json.load(f)
        self.assertEqual(got["shape"], [1, 6, 256])
        m = L.load_model(d)
        a, b = m(torch.tensor([[3, 4, 5]])), m(torch.tensor([[6, 7, 8]]))
        torch.testing.assert_close(torch.tensor(got["logits"]), torch.cat((a, b), 1), rtol=1e-5, atol=1e-6)
        gen = subprocess.run([sys.executable, script, "generate", d, "--tokens", tok, "--max-new", "4"],
                             check=True, capture_output=True, text=True).stdout
        g = json.loads(gen)
        self.assertEqual(g["new_tokens"], m.generate_uncached(torch.tensor([[3, 4, 5, 6, 7, 8]]), 4).tolist())


class Trainer(unittest.TestCase):
    def test_mt19937_64_and_sampler(self):
        r = L.MT19937_64(5489)
        for _ in range(9999):
            r()
        self.assertEqual(r(), 9981545732273789042)  # the C++ standard's check value
        tokens = torch.arange(1000) % 251
        s = L.WindowSampler(tokens, 10, 8, 1337)
        self.assertEqual(s.num_windows, 99)
        order = s.order(0)
        self.assertEqual(sorted(order), list(range(99)))
        self.assertNotEqual(order, list(range(99)))
        self.assertNotEqual(s.order(1), order)
        x, y = s.global_batch(0)
        self.assertEqual(list(x.shape), [8, 10])
        for r_ in range(8):
            start = order[r_] * 10
            self.assertEqual(x[r_].tolist(), tokens[start:start + 10].tolist())
            self.assertEqual(y[r_].tolist(), tokens[start + 1:start + 11].tolist())
        x12, _ = s.global_batch(12 + 1)  # 12 steps per epoch: step 13 is epoch 1's second
        self.assertEqual(x12[0, 0].item(), tokens[s.order(1)[8] * 10].item())
        plain = L.WindowSampler(tokens, 10, 8, 1337, shuffle=False)
        self.assertEqual(plain.global_batch(1)[0][0, 0].item(), tokens[80].item())
        self.assertEqual(len(L.lm_train_tokens(tokens, 0.05, 10, 4)), 1000 - 50)
        self.assertEqual(len(L.lm_train_tokens(tokens, 0.01, 10, 4)), 1000 - 41)

    def test_schedule(self):
        f = L.scheduled_lr
        self.assertEqual([f(s, 1.0, 0.1, 4, 10) for s in range(4)], [0.25, 0.5, 0.75, 1.0])
        self.assertAlmostEqual(f(4, 1.0, 0.1, 4, 10), 1.0)
        self.assertAlmostEqual(f(7, 1.0, 0.1, 4, 10), 0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
        self.assertAlmostEqual(f(10, 1.0, 0.1, 4, 10), 0.1)
        self.assertAlmostEqual(f(20, 1.0, 0.1, 4, 10), 0.1)
        self.assertAlmostEqual(f(7, 1.0, 0.1, 4, 10, "linear"), 0.55)
        self.assertEqual(f(9, 1.0, 0.1, 4, 10, "constant"), 1.0)
        self.assertEqual(f(0, 1.0, 0.1, 0, 10), 1.0)

    def _args(self, **kw):
        a = dict(steps=4, lr=1e-2, min_lr=1e-3, warmup=2, schedule="cosine", max_steps=0,
                 weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, max_grad_norm=1.0)
        a.update(kw)
        return types.SimpleNamespace(**a)

    def test_training_micro_split_and_ignore(self):
        torch.manual_seed(0)
        rows = torch.randint(0, 256, (4, 4, 9))  # steps x rows x (T+1)
        tgt = rows[:, :, 1:].clone()
        tgt[:, 0, :3] = L.IGNORE_INDEX

        def batches(micro):
            def f(s):
                b = {"input": rows[s, :, :-1], "target": tgt[s], "position": None, "segment": None}
                return L._split(b, micro)
            return f
        runs = []
        for micro in (0, 1):
            m = random_model(7).train()
            recs = L.train(m, batches(micro), self._args())
            runs.append((recs, {n: p.detach().clone() for n, p in m.named_parameters()}))
        (r0, p0), (r1, p1) = runs
        self.assertEqual(r0[0]["targets"], 4 * 8 - 3)
        for a, b in zip(r0, r1):
            self.assertAlmostEqual(a["loss"], b["loss"], places=5)
            self.assertAlmostEqual(a["grad_norm"], b["grad_norm"], places=4)
        # Adam divides by sqrt(v): rounding differences between the two
        # splits grow where a gradient is near zero, hence atol 1e-4 (lr 1e-2)
        for n in p0:
            torch.testing.assert_close(p0[n], p1[n], rtol=1e-4, atol=1e-4)
        self.assertLess(r0[-1]["loss"], r0[0]["loss"])
        # step-1 loss is the mean cross entropy over non-ignored targets
        m = random_model(7)
        with torch.no_grad():
            lg = m(rows[0, :, :-1])
            want = torch.nn.functional.cross_entropy(lg.reshape(-1, 256), tgt[0].reshape(-1), ignore_index=-100)
        self.assertAlmostEqual(r0[0]["loss"], float(want), places=5)

    def test_weight_decay_only_on_matrices(self):
        m = random_model(8).train()
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        idx = torch.zeros(1, 4, dtype=torch.long)

        def zero_batches(s):  # one target; the decay-free run below isolates the decay
            t = torch.full((1, 4), L.IGNORE_INDEX)
            t[0, 0] = 1
            return [{"input": idx, "target": t, "position": None, "segment": None}]
        opt_args = self._args(steps=1, lr=0.5, warmup=0, schedule="constant", weight_decay=0.1)
        L.train(m, zero_batches, opt_args)
        m2 = random_model(8).train()
        L.train(m2, zero_batches, self._args(steps=1, lr=0.5, warmup=0, schedule="constant", weight_decay=0.0))
        for (n, p), (_, q) in zip(m.named_parameters(), m2.named_parameters()):
            if p.dim() >= 2:
                torch.testing.assert_close(p, q - 0.5 * 0.1 * before[n], rtol=1e-5, atol=1e-6)
            else:
                torch.testing.assert_close(p, q, rtol=0, atol=0)


class Lora(unittest.TestCase):
    """LoRA adapters in the Hugging Face PEFT layout (make-adapter, --adapter)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        self.model_dir = os.path.join(self.dir, "m")
        L.make_tiny(self.model_dir, seed=11, attention_bias=True)  # biases: they must stay frozen too
        self.idx = torch.tensor([[5, 17, 3, 250, 9, 44, 1, 0, 77]])

    def tearDown(self):
        self.tmp.cleanup()

    def _adapter(self, name, **kw):
        out = os.path.join(self.dir, name)
        kw.setdefault("r", 4)
        kw.setdefault("alpha", 16)
        L.make_adapter(self.model_dir, out, **kw)
        return out

    def _adapted(self, adapter_dir):
        m = L.load_model(self.model_dir)
        L.load_adapter(m, adapter_dir)
        return m.eval()

    def test_zero_b_gives_base_logits(self):
        ad = self._adapter("zero", b_scale=0.0, seed=3)
        t = L.read_safetensors(os.path.join(ad, L.PEFT_WEIGHTS))[0]
        self.assertTrue(all(float(v.abs().sum()) == 0 for n, v in t.items() if n.endswith("lora_B.weight")))
        self.assertTrue(all(float(v.abs().sum()) > 0 for n, v in t.items() if n.endswith("lora_A.weight")))
        base = L.load_model(self.model_dir).eval()
        with torch.no_grad():
            torch.testing.assert_close(self._adapted(ad)(self.idx), base(self.idx), rtol=0, atol=0)

    def _merged_by_hand(self, adapter_dir, scale):
        config, tensors = L.load_hf_dir(self.model_dir)
        ad = L.read_safetensors(os.path.join(adapter_dir, L.PEFT_WEIGHTS))[0]
        merged = {n: t.clone() for n, t in tensors.items()}
        n_adapted = 0
        for name in ad:
            if not name.endswith(".lora_A.weight"):
                continue
            module = name[len("base_model.model."):-len(".lora_A.weight")]
            a, b = ad[name], ad[name.replace("lora_A", "lora_B")]
            merged[module + ".weight"] = tensors[module + ".weight"] + scale * (b @ a)
            n_adapted += 1
        m = L.LlamaRef(config)
        m.load_state_dict(merged)  # strict: every base tensor present
        return m.eval(), n_adapted

    def test_scale_equals_hand_merged_weights(self):
        ad = self._adapter("ad", r=4, alpha=16, seed=5, b_scale=0.05)
        base = L.load_model(self.model_dir).eval()
        with torch.no_grad():
            got = self._adapted(ad)(self.idx)
            merged, n = self._merged_by_hand(ad, 16 / 4)
            self.assertEqual(n, 2 * 7)
            torch.testing.assert_close(got, merged(self.idx), rtol=0, atol=1e-5)
            self.assertGreater(float((got - base(self.idx)).abs().max()), 1e-2)  # it does change the output
            # merged_state folds the same W + (alpha/r) B A
            m = self._adapted(ad)
            plain = L.LlamaRef(m.cfg)
            plain.load_state_dict(L.merged_state(m))
            torch.testing.assert_close(plain.eval()(self.idx), got, rtol=0, atol=1e-5)
            # use_rslora: alpha / sqrt(r)
            with open(os.path.join(ad, L.PEFT_CONFIG)) as f:
                cfg = json.load(f)
            cfg["use_rslora"] = True
            with open(os.path.join(ad, L.PEFT_CONFIG), "w") as f:
                json.dump(cfg, f)
            merged_rs, _ = self._merged_by_hand(ad, 16 / math.sqrt(4))
            torch.testing.assert_close(self._adapted(ad)(self.idx), merged_rs(self.idx), rtol=0, atol=1e-5)

    def test_missing_and_unexpected_tensors_are_named(self):
        ad = self._adapter("ad", targets=["q_proj", "v_proj"])
        path = os.path.join(ad, L.PEFT_WEIGHTS)
        t = L.read_safetensors(path)[0]
        gone = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
        L.write_safetensors(path, {n: v for n, v in t.items() if n != gone})
        with self.assertRaisesRegex(ValueError, "missing from the file: " + gone.replace(".", r"\.")):
            self._adapted(ad)
        extra = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"  # up_proj is not a target
        L.write_safetensors(path, dict(t, **{extra: torch.zeros(4, 64)}))
        with self.assertRaisesRegex(ValueError, "unexpected.*" + extra.replace(".", r"\.")):
            self._adapted(ad)
        L.write_safetensors(path, dict(t, **{gone: torch.zeros(3, 4)}))
        with self.assertRaisesRegex(ValueError, "shapes differ"):
            self._adapted(ad)

    def _batches(self):
        torch.manual_seed(1)
        rows = torch.randint(0, 256, (4, 9))

        def f(s):  # the same rows each step: the loss must fall
            return [{"input": rows[:, :-1], "target": rows[:, 1:], "position": None, "segment": None}]
        return f

    def _args(self, **kw):
        a = dict(steps=3, lr=1e-2, min_lr=1e-3, warmup=0, schedule="cosine", max_steps=0,
                 weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, max_grad_norm=1.0, autocast="")
        a.update(kw)
        return types.SimpleNamespace(**a)

    def test_training_moves_only_a_and_b(self):
        ad = self._adapter("ad", seed=2)
        runs = {}
        for autocast in ("", "bf16"):
            m = L.load_model(self.model_dir).train()
            L.load_adapter(m, ad)
            before = {n: p.detach().clone() for n, p in m.named_parameters()}
            trainable = sorted(n for n, p in m.named_parameters() if p.requires_grad)
            self.assertEqual(len(trainable), 2 * 7 * 2)
            self.assertTrue(all(".lora_A." in n or ".lora_B." in n for n in trainable))
            recs = L.train(m, self._batches(), self._args(autocast=autocast))
            for n, p in m.named_parameters():
                if ".lora_" in n:
                    self.assertFalse(torch.equal(p, before[n]), f"{n} did not train ({autocast or 'fp32'})")
                else:  # base weights, norms, embeddings and the attention biases
                    self.assertTrue(torch.equal(p, before[n]), f"{n} changed ({autocast or 'fp32'})")
            self.assertLess(recs[-1]["loss"], recs[0]["loss"])
            runs[autocast] = recs
        for a, b in zip(runs[""], runs["bf16"]):
            self.assertAlmostEqual(a["loss"], b["loss"], delta=0.05)

    def test_weight_decay_applies_to_a_and_b(self):
        ad = self._adapter("ad", seed=4)
        got = {}
        for wd in (0.1, 0.0):
            m = L.load_model(self.model_dir).train()
            L.load_adapter(m, ad)
            before = {n: p.detach().clone() for n, p in m.named_parameters()}
            L.train(m, self._batches(), self._args(steps=1, lr=0.5, schedule="constant", weight_decay=wd))
            got[wd] = {n: p.detach().clone() for n, p in m.named_parameters() if ".lora_" in n}
        for n in got[0.1]:
            torch.testing.assert_close(got[0.1][n], got[0.0][n] - 0.5 * 0.1 * before[n], rtol=1e-5, atol=1e-6)

    def test_make_adapter_peft_layout(self):
        script = os.path.join(HERE, "llama_ref.py")
        ad = os.path.join(self.dir, "cli")
        subprocess.run([sys.executable, script, "make-adapter", self.model_dir, ad, "--r", "3", "--alpha", "6",
                        "--seed", "7"], check=True, stdout=subprocess.DEVNULL)
        self.assertEqual(sorted(os.listdir(ad)), ["adapter_config.json", "adapter_model.safetensors"])
        with open(os.path.join(ad, "adapter_config.json")) as f:
            cfg = json.load(f)
        self.assertEqual(cfg, {"peft_type": "LORA", "r": 3, "lora_alpha": 6,
                               "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"],
                               "lora_dropout": 0.0, "fan_in_fan_out": False, "bias": "none",
                               "base_model_name_or_path": "", "task_type": "CAUSAL_LM"})
        with open(os.path.join(ad, "adapter_model.safetensors"), "rb") as f:
            raw = f.read()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        header.pop("__metadata__", None)
        # hidden 64, 4 heads of 16, 2 kv heads, intermediate 160, 2 layers
        io = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32), "self_attn.v_proj": (64, 32),
              "self_attn.o_proj": (64, 64), "mlp.gate_proj": (64, 160), "mlp.up_proj": (64, 160),
              "mlp.down_proj": (160, 64)}
        want = {}
        for layer in range(2):
            for mod, (fan_in, fan_out) in io.items():
                stem = f"base_model.model.model.layers.{layer}.{mod}"
                want[stem + ".lora_A.weight"] = [3, fan_in]
                want[stem + ".lora_B.weight"] = [fan_out, 3]
        self.assertEqual({k: e["shape"] for k, e in header.items()}, want)
        self.assertTrue(all(e["dtype"] == "F32" for e in header.values()))
        t = L.read_safetensors(os.path.join(ad, "adapter_model.safetensors"))[0]
        self.assertAlmostEqual(float(torch.cat([v.reshape(-1) for k, v in t.items() if "lora_A" in k]).std()),
                               0.02, delta=0.002)
        self.assertGreater(float(t["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].abs().max()), 0)
        # same seed, same adapter; --targets picks modules by name suffix
        again = os.path.join(self.dir, "again")
        L.make_adapter(self.model_dir, again, 3, 6, seed=7)
        t2 = L.read_safetensors(os.path.join(again, "adapter_model.safetensors"))[0]
        self.assertTrue(all(torch.equal(t[k], t2[k]) for k in t))
        sub = os.path.join(self.dir, "sub")
        L.make_adapter(self.model_dir, sub, 2, 4, targets=["q_proj", "down_proj"])
        names = sorted(L.read_safetensors(os.path.join(sub, "adapter_model.safetensors"))[0])
        self.assertEqual(names, sorted(f"base_model.model.model.layers.{i}.{m}.lora_{x}.weight"
                                       for i in range(2) for m in ("mlp.down_proj", "self_attn.q_proj")
                                       for x in "AB"))
        with self.assertRaisesRegex(ValueError, "match no module"):
            L.make_adapter(self.model_dir, os.path.join(self.dir, "bad"), 2, 4, targets=["qkv_proj"])

    def test_cli_train_out_adapter_roundtrip(self):
        script = os.path.join(HERE, "llama_ref.py")
        ad, trained = os.path.join(self.dir, "ad"), os.path.join(self.dir, "trained")
        subprocess.run([sys.executable, script, "make-adapter", self.model_dir, ad, "--r", "2", "--alpha", "4",
                        "--targets", "q_proj,v_proj,down_proj"], check=True, stdout=subprocess.DEVNULL)
        batches = os.path.join(self.dir, "b.json")
        torch.manual_seed(2)
        with open(batches, "w") as f:
            json.dump({"steps": [{"tokens": torch.randint(0, 256, (2, 9)).tolist()} for _ in range(2)]}, f)
        weights = os.path.join(self.dir, "w.safetensors")
        report = json.loads(subprocess.run(
            [sys.executable, script, "train", self.model_dir, "--steps", "2", "--batches", batches,
             "--warmup", "0", "--adapter", ad, "--out-adapter", trained, "--out-weights", weights,
             "--autocast", "bf16"], check=True, capture_output=True, text=True).stdout)
        self.assertEqual(len(report["losses"]), 2)
        self.assertEqual(report["lora"]["scale"], 2.0)
        with open(os.path.join(ad, L.PEFT_CONFIG)) as f, open(os.path.join(trained, L.PEFT_CONFIG)) as g:
            self.assertEqual(json.load(f), json.load(g))
        t0 = L.read_safetensors(os.path.join(ad, L.PEFT_WEIGHTS))[0]
        t1 = L.read_safetensors(os.path.join(trained, L.PEFT_WEIGHTS))[0]
        self.assertEqual({k: list(v.shape) for k, v in t0.items()}, {k: list(v.shape) for k, v in t1.items()})
        self.assertTrue(all(v.dtype == torch.float32 for v in t1.values()))
        self.assertTrue(all(not torch.equal(t0[k], t1[k]) for k in t0))
        # the trained adapter on the base == the merged --out-weights
        tok = os.path.join(self.dir, "t.json")
        with open(tok, "w") as f:
            json.dump({"tokens": self.idx.tolist()}, f)
        out = os.path.join(self.dir, "o.json")
        subprocess.run([sys.executable, script, "logits", self.model_dir, "--tokens", tok, "--adapter", trained,
                        "--out", out], check=True)
        with open(out) as f:
            got = torch.tensor(json.load(f)["logits"])
        merged = L.LlamaRef(L.load_hf_dir(self.model_dir)[0])
        merged.load_state_dict(L.read_safetensors(weights)[0])
        with torch.no_grad():
            torch.testing.assert_close(got, merged.eval()(self.idx), rtol=0, atol=1e-5)


if __name__ == "__main__":
    unittest.main(verbosity=2)
