"""The transformers engine (episode.LocalEngine): generation on this rank's device with its own
copy of the weights, loaded from the sync's buckets (the twin of vllm_engine.py)."""
from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import device as D
import families
import inputs as I
import model as M
import routing as R
import sync as S
from episode import Check, Completion, Prompt, Sampling, WeightSource


class _Checked(StoppingCriteria):
    """Calls `check()` after each decode step; `seen[t]`: the version token t was sampled with
    (`version`, the call's, first). Ends the call after the step where it returns another
    version (the rows go on elsewhere, under the new weights), or with `keep` (`rollout.partial
    = "keep"`) never: `check()` loads newer weights in place (pipeline.Producer.check), so the
    next step runs them on the past key values as they are."""

    def __init__(self, check: Check, version: int, keep: bool):
        self.check, self.keep, self.seen = check, keep, [version]

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.seen.append(self.check())
        changed = not self.keep and self.seen[-1] != self.seen[0]
        return torch.full((input_ids.shape[0],), changed, dtype=torch.bool, device=input_ids.device)


class HFEngine:
    """transformers generation on this rank's device, with its own copy of the weights (an
    episode.LocalEngine)."""
    OWN_CHANNEL = False
    STEPS_SHARED = False  # one model.generate at a time (its KV cache is the call's)

    def __init__(self, path: str, dtype: torch.dtype, procs: I.Processors, device: torch.device,
                 keep: bool = False):
        self.model = M.load_model(path, dtype=dtype, device=device).eval()
        self.keep = keep  # rollout.partial = "keep": a check's new weights go on the KV as it is
        self.procs, self.tokens, self.device = procs, procs.tokens, device
        # MoE: what each generate call routed is recorded (routing.capture) and kept per token
        self.experts = (getattr(M.text_config(self.model.config), "num_experts", 0)
                        if families.moe_routers(self.model) else 0)

    @classmethod
    def start_note(cls, rc, config) -> str:
        return ""  # no prefix cache, nothing decided

    @classmethod
    def from_config(cls, cfg, path: str, procs: I.Processors, *, dev: D.Device,
                    device: torch.device, seed: int, max_images: int = 1) -> "HFEngine":
        return cls(path, M.DTYPES[cfg.model.dtype], procs, device, keep=cfg.rollout.partial == "keep")

    def generate(self, rows: list[Prompt], sp: Sampling, seed: int,
                 check: Check | None = None) -> list[list[Completion]]:
        """episode.Engine.generate: one transformers generate call seeded with `seed`; a
        check ends it at the decode step where its version changes, or with `keep` its new
        weights are decoded on with the past key values kept (each token its own version)."""
        stop = None if check is None else _Checked(check, check(), self.keep)
        resp, lp, routes, before = self._sample(rows, sp, seed, stop)
        per_row = 1 if sp.greedy else sp.n
        result: list[list[Completion]] = [[] for _ in rows]
        for i, (r, l, x, b) in enumerate(zip(resp, lp, routes, before)):
            # tokens up to the first stop (included); none: the budget or the check ended it
            n = next((j + 1 for j, t in enumerate(r) if t in self.tokens.stops), len(r))
            truncated = not r or r[n - 1] not in self.tokens.stops
            result[i // per_row].append(Completion(r[:n], l[:n], truncated=truncated,
                                                   versions=[] if stop is None else stop.seen[:n],
                                                   routing=None if x is None else x[:n], prompt_routing=b,
                                                   kv_kept=self.keep and check is not None))
        return result

    @torch.no_grad()
    def _sample(self, prompts: list[Prompt], sp: Sampling, seed: int,
                stop: StoppingCriteria | None) -> tuple[list, list, list, list]:
        """One transformers generate call: every row's sampled tokens and their logprobs
        (lists; rows prompt-major, sp.n per prompt, 1 when greedy), up to max_new_tokens, and
        for a MoE model each row's routing [T, L, k] and its prompt's but the last token's
        [P - 1, L, k] (routing.generated_routing, routing.prompt_routing; else None); `stop`
        may end the call at a decode step."""
        tk = self.tokens
        images, ip = [im for _, ims in prompts for im in ims], self.procs.image_processor
        mm = I.image_inputs(ip, images) if images else {}
        counts = iter(I.n_image_tokens(mm["image_grid_thw"], ip.merge_size) if mm else ())
        rows = [I.expand_images(ids, [next(counts) for _ in ims], tk.image_pad) for ids, ims in prompts]
        width = max(map(len, rows))
        # left padding: generated tokens line up; positions (mRoPE) come from the mask
        ids = torch.tensor([[tk.pad] * (width - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        knobs = (dict(do_sample=False) if sp.greedy else
                 dict(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k))
        # images: their pixels, grids and where their tokens sit (mRoPE)
        mm_kw = {} if not mm else dict(pixel_values=mm["pixel_values"].to(self.device, self.model.dtype),
                                       image_grid_thw=mm["image_grid_thw"].to(self.device),
                                       mm_token_type_ids=(ids == tk.image_pad).int())
        with D.fork_rng(self.device), (R.capture(self.model) if self.experts else nullcontext()) as calls:
            torch.manual_seed(seed)  # fork_rng: the device type explicitly (NPU: not "cuda")
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, **mm_kw, **knobs,
                num_return_sequences=1 if sp.greedy else sp.n, max_new_tokens=sp.max_new_tokens,
                suppress_tokens=list(tk.suppressed), eos_token_id=list(tk.stops), pad_token_id=tk.pad,
                stopping_criteria=None if stop is None else StoppingCriteriaList([stop]),
                output_logits=True, return_dict_in_generate=True)
        resp = out.sequences[:, width:]                                   # [P*n, T]
        logits = torch.stack(out.logits, 1)                               # [P*n, T, V] raw
        lp, _ = M.token_logprobs(logits, resp, tk, 1.0 if sp.greedy else sp.temperature)
        if not self.experts:
            return resp.tolist(), lp.tolist(), [None] * resp.shape[0], [None] * resp.shape[0]
        routes = list(R.generated_routing(calls, *resp.shape, self.experts).cpu())
        per = resp.shape[0] // len(rows)                                  # rows prompt-major
        before = R.prompt_routing(calls, [len(rows[i // per]) for i in range(resp.shape[0])], self.experts)
        return resp.tolist(), lp.tolist(), routes, before

    @torch.no_grad()
    def load_weights(self, named: list[tuple[str, torch.Tensor]], adopt: bool = False) -> None:
        """Copy `named` (sync.wire_pieces' names) into the model, or with `adopt` make a whole
        tensor the model's storage (it must outlive the model: sync.Receiver's buffers do)."""
        if not hasattr(self, "_targets"):
            params = list(self.model.named_parameters())
            self._targets = {name: (params[pos][1], index)
                             for name, _, pos, index in S.wire_pieces(self.model)}
        for name, t in named:
            p, index = self._targets[name]
            if (not index and adopt and t.dtype == p.dtype and t.device == p.device
                    and t.shape == p.shape):
                if p.data_ptr() != t.data_ptr():
                    p.data = t
            else:
                (p[index] if index else p).copy_(t)

    def sleep(self) -> None:
        """Colocated (cluster.colocate): free the device for the train phase. transformers keeps
        no KV cache between generate calls, so the weights alone move to host memory."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            D.release_cached_memory(self.device)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Back on the device: "weights" brings them back (a no-op on CPU), "kv_cache" has
        nothing to allocate (made per generate call); None: both."""
        if (tags is None or "weights" in tags) and self.device.type != "cpu":
            self.model.to(self.device)

    def receive_weights(self, source: WeightSource) -> int:
        """Every bucket of a sync, in order, adopted as this engine's weights (the receiver's
        buffers live across syncs, so later syncs land in place with no copy)."""
        version, _ = source.control()
        for named in source.buckets():
            self.load_weights(named, adopt=True)
        return version

    def named_parameters(self):
        return self.model.named_parameters()

    def shutdown(self) -> None:
        self.model = None
