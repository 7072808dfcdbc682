"""The settings of each role, declared once: one frozen dataclass per role (target worker, draft
worker, scheduler, public server, Ray deployment, replicas), each field with its default, its help
text (`setting`) and its check (in `__post_init__`; a bad value raises ConfigError naming the
field). specdec.config composes them into ServiceConfig and gives each field its flat name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdec.addresses import host_port, is_loopback

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TARGET = REPO_ROOT / "models" / "target"
SHIPPED_DRAFT = REPO_ROOT / "models" / "draft"
NGRAM = "ngram"  # the draft "model" that is prompt lookup, not a checkpoint
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_FORMATS = ("auto", "fp", "q8", "q4")  # specdec.model.quantized
KV_CACHE_DTYPES = ("auto", "float32", "float16")


class ConfigError(ValueError):
    """A setting has a bad value; the message names the setting."""


def setting(default, help: str):
    return field(default=default, metadata={"help": help})


def _check(ok: bool, where: str, requirement: str, value) -> None:
    if not ok:
        raise ConfigError(f"{where} must be {requirement}, got {value!r}")


def _positive(where: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, where,
           "a positive integer" + (" or unset" if optional else ""), value)


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker runs its model. The target's and the draft's are separate objects."""

    device: str = setting("cpu", "cpu, cuda or cuda:N")
    dtype: str = setting("auto", "float32, bfloat16, float16, or auto: float32 on CPU, bfloat16 on CUDA")
    kv_cache_blocks: int | None = setting(
        None, "KV-cache blocks per worker; unset: on CUDA from kv_memory_fraction, on CPU room for 32 "
              "sequences of the full context, at most kv_cache_max_bytes")
    kv_block_size: int = setting(16, "tokens per KV-cache block")
    kv_cache_max_bytes: int = setting(1 << 30, "memory cap of the default KV-cache size, in bytes")
    kv_cache_dtype: str = setting(
        "auto", "what the KV cache holds: auto (the model's dtype), float32 or float16; float16 on CPU halves the "
                "cache's memory and what attention reads (as llama.cpp's default cache), its keys and values "
                "rounded to float16 (plain and speculative decoding alike)")
    num_threads: int | None = setting(None, "torch intra-op threads of the worker; unset: torch's default")
    kv_memory_fraction: float = setting(
        0.9, "on CUDA, unless kv_cache_blocks is set: the share of the GPU's total memory this worker may "
             "hold, weights, measured activation headroom and KV cache together (like other servers' GPU "
             "memory utilisation); workers sharing a GPU need shares that sum to at most 1, and none takes "
             "more than is free when it starts; on CPU the fixed default size applies")
    packed_weights: bool = setting(
        True, "on CPU without specdec's C kernels (cpu_kernels off or no compiler), also keep a oneDNN-packed "
              "copy of every weight matrix for passes of several tokens: about 2x faster there, twice the "
              "weight memory")
    prefill_chunk_tokens: int = setting(
        2048, "the most new tokens a forward pass takes in all: longer prompts are fed in chunks of this many, "
              "so a pass's memory is bounded by it rather than by the prompts (on CUDA the KV cache leaves "
              "room for the activations of such a pass)")
    weights: str = setting(
        "auto", "how weight matrices are held and multiplied: fp (floats of the dtype), q8 or q4 (8- or 4-bit "
                "codes with a scale per 32 numbers, computed as codes: in specdec's C kernels on CPU (float32), "
                "in a Triton kernel on CUDA), or auto: a GGUF file's own quantization (Q8_0, Q4_0 and Q4_1 "
                "exactly, other types at the nearest of q8/q4) where codes run, floats otherwise")
    cpu_kernels: bool = setting(
        True, "on CPU (float32), run every forward pass in specdec's C kernels, built on first use with the "
              "system's C compiler: faster for small models, and batch-invariant (a token's logits do not "
              "depend on how it was scheduled); torch's ops where no compiler is found")
    cuda_graph_max_batch: int = setting(
        32, "on CUDA (with Triton installed), replay decode, draft and verify passes of up to this many "
            "sequences from CUDA graphs captured at start (one launch per pass instead of hundreds); "
            "0 runs every pass eagerly")

    role = "worker"  # names the fields in error messages
    # What weights=auto makes of a float checkpoint where the C kernels run (model.decoder).
    auto_float_format = "fp"

    def __post_init__(self) -> None:
        _check(isinstance(self.device, str) and self.device.split(":")[0] in ("cpu", "cuda"),
               f"{self.role}.device", "cpu, cuda or cuda:N", self.device)
        _check(self.dtype in DTYPES, f"{self.role}.dtype", f"one of {', '.join(DTYPES)}", self.dtype)
        _positive(f"{self.role}.kv_cache_blocks", self.kv_cache_blocks, optional=True)
        _positive(f"{self.role}.kv_block_size", self.kv_block_size)
        _positive(f"{self.role}.kv_cache_max_bytes", self.kv_cache_max_bytes)
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, f"{self.role}.kv_cache_dtype",
               f"one of {', '.join(KV_CACHE_DTYPES)}", self.kv_cache_dtype)
        _positive(f"{self.role}.num_threads", self.num_threads, optional=True)
        _check(isinstance(self.kv_memory_fraction, (int, float)) and 0 < self.kv_memory_fraction <= 1,
               f"{self.role}.kv_memory_fraction", "a number in (0, 1]", self.kv_memory_fraction)
        _check(isinstance(self.packed_weights, bool), f"{self.role}.packed_weights", "true or false",
               self.packed_weights)
        _check(self.weights in WEIGHT_FORMATS, f"{self.role}.weights", f"one of {', '.join(WEIGHT_FORMATS)}",
               self.weights)
        _check(isinstance(self.cpu_kernels, bool), f"{self.role}.cpu_kernels", "true or false",
               self.cpu_kernels)
        _positive(f"{self.role}.prefill_chunk_tokens", self.prefill_chunk_tokens)
        _check(isinstance(self.cuda_graph_max_batch, int) and not isinstance(self.cuda_graph_max_batch, bool)
               and self.cuda_graph_max_batch >= 0, f"{self.role}.cuda_graph_max_batch", "an integer >= 0",
               self.cuda_graph_max_batch)

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"


@dataclass(frozen=True)
class TargetConfig(WorkerConfig):
    model: str = setting(str(SHIPPED_TARGET), "target model: checkpoint directory, .gguf file or Hub id "
                                              "(owner/name[@revision], from the local Hugging Face cache)")

    role = "target"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(isinstance(self.model, str) and bool(self.model), "target.model",
               "a checkpoint directory, .gguf file or Hub id", self.model)


@dataclass(frozen=True)
class DraftConfig(WorkerConfig):
    model: str | None = setting(None, f"draft model: checkpoint directory, .gguf file or Hub id; "
                                      f"'{NGRAM}' (prompt lookup) or none")
    max_q_entries: int = setting(256, "proposal distribution entries sent per draft token (sampled requests)")
    ngram_max: int = setting(4, "longest suffix the n-gram drafter looks up")
    ngram_min: int = setting(1, "shortest suffix the n-gram drafter looks up")
    ngram_window: int = setting(2048, "most recent tokens the n-gram drafter searches")
    weights: str = setting(
        "auto", "how weight matrices are held and multiplied: fp, q8 or q4 (as the target's), or auto: a GGUF "
                "file's own quantization where codes run (as the target's), a float checkpoint as q8 on CPU "
                "(float32, C kernels), floats otherwise")

    role = "draft"
    # The draft's numbers decide only which tokens are proposed, never which are output, and a draft
    # step right after a target pass reads its weights from memory: q8 is a quarter of the bytes
    # (docs/bench-2026-11-27-draft-step.md).
    auto_float_format = "q8"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.model, str) and self.model.lower() == "none":
            object.__setattr__(self, "model", None)
        _check(self.model is None or (isinstance(self.model, str) and bool(self.model)), "draft.model",
               f"a checkpoint directory, .gguf file or Hub id, '{NGRAM}' or none", self.model)
        _positive("draft.max_q_entries", self.max_q_entries)
        _positive("draft.ngram_min", self.ngram_min)
        _positive("draft.ngram_window", self.ngram_window)
        _check(isinstance(self.ngram_max, int) and self.ngram_max >= self.ngram_min, "draft.ngram_max",
               f"an integer >= ngram_min ({self.ngram_min})", self.ngram_max)

    @property
    def kind(self) -> str:
        """"none" (no speculation), "ngram" or "model"."""
        if self.model is None:
            return "none"
        return NGRAM if self.model == NGRAM else "model"


@dataclass(frozen=True)
class SchedulerConfig:
    num_speculative_tokens: int = setting(5, "the most draft tokens per round (K); 0: no speculation")
    adaptive: bool = setting(True, "choose K per request and round (0 to the maximum) from acceptance and "
                                   "measured costs; no: always the maximum")
    max_batch_size: int = setting(32, "requests per round at most")
    # Off by default: on the 2-core reference machine it measured slower than serial rounds
    # (README "Overlapped drafting"); turn it on where draft and target have their own devices.
    overlap: bool = setting(False, "overlapped drafting: the draft drafts round r+1 while the target verifies "
                                   "round r, kept only if round r commits what it assumed; no: serial rounds")
    tree_branches: int = setting(1, "draft token trees: this many children of the last committed token, the "
                                    "first continued K deep, all verified in one pass (adaptive: each round a "
                                    "chain or such a tree per request, whichever the policy prices better); "
                                    "1: chains")
    tree_side_depth: int = setting(0, "with tree_branches > 1: how deep the root's other children are grown (1: "
                                      "leaves, alternatives to the first token only; adaptive: at most); 0: K "
                                      "deep, like the first")
    worker_round_timeout: float = setting(
        30.0, "seconds a worker may take to answer one round before it is treated as dead (hung)")
    worker_recovery_timeout: float = setting(
        60.0, "seconds a dead worker may take to come back (Ray restarts it) before its requests fail")

    # A request may ask for its own K up to this bound.
    max_request_speculative_tokens = 64

    def __post_init__(self) -> None:
        _check(isinstance(self.num_speculative_tokens, int)
               and 0 <= self.num_speculative_tokens <= self.max_request_speculative_tokens,
               "scheduler.num_speculative_tokens", f"an integer in [0, {self.max_request_speculative_tokens}]",
               self.num_speculative_tokens)
        _positive("scheduler.max_batch_size", self.max_batch_size)
        _check(isinstance(self.tree_branches, int) and 1 <= self.tree_branches <= 16, "scheduler.tree_branches",
               "an integer in [1, 16]", self.tree_branches)
        most = self.max_request_speculative_tokens
        _check(isinstance(self.tree_side_depth, int) and 0 <= self.tree_side_depth <= most,
               "scheduler.tree_side_depth", f"an integer in [0, {most}]", self.tree_side_depth)
        # A pre-draft assumes the proposal under verification is accepted whole: one chain.
        _check(self.tree_branches == 1 or not self.overlap, "scheduler.tree_branches",
               "1 with scheduler.overlap on (overlapped drafting assumes a chain)", self.tree_branches)
        for name in ("worker_round_timeout", "worker_recovery_timeout"):
            _check(getattr(self, name) > 0, f"scheduler.{name}", "a number of seconds > 0", getattr(self, name))


@dataclass(frozen=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "public bind address of the gRPC and HTTP APIs (0.0.0.0: every interface; "
                                     "then also set auth_token and TLS)")
    port: int = setting(50051, "public gRPC port (0: any free port)")
    http_port: int = setting(8000, "public port of the OpenAI-compatible HTTP API (0: off; -1: any free port)")
    tls_cert: str | None = setting(None, "PEM certificate for the public ports (with tls_key)")
    tls_key: str | None = setting(None, "PEM private key for the public ports")
    auth_token: str | None = setting(None, "require 'authorization: Bearer <token>' on every gRPC and HTTP call "
                                           "but health")
    grace_period: float = setting(30.0, "seconds in-flight requests may take to finish when the server stops")
    max_concurrent_rpcs: int | None = setting(None, "public RPCs served at once; unset: no limit")
    max_request_bytes: int = setting(4 << 20, "largest request accepted, in bytes: the gRPC message limit and "
                                              "the HTTP body limit (larger: RESOURCE_EXHAUSTED / HTTP 413)")
    max_stop_strings: int = setting(16, "stop strings one request may give")
    max_stop_string_length: int = setting(256, "characters one stop string may have")
    max_waiting_requests: int = setting(1024, "requests admitted but not yet started (queued, or being "
                                              "tokenized) beyond which new ones are refused "
                                              "(RESOURCE_EXHAUSTED / HTTP 429)")
    max_request_bytes_in_flight: int = setting(
        32 << 20, "request bytes being read, parsed or tokenized at once, across both APIs (a request not yet "
                  "read counts as max_request_bytes, or its Content-Length); past it requests wait briefly, "
                  "then RESOURCE_EXHAUSTED / HTTP 429")

    def __post_init__(self) -> None:
        _check(isinstance(self.port, int) and 0 <= self.port < 65536, "server.port", "a port number", self.port)
        _check(isinstance(self.http_port, int) and -1 <= self.http_port < 65536, "server.http_port",
               "a port number, 0 (off) or -1 (any free port)", self.http_port)
        _check((self.tls_cert is None) == (self.tls_key is None), "server.tls_key",
               "given together with tls_cert", self.tls_key)
        _check(self.grace_period >= 0, "server.grace_period", "a number of seconds >= 0", self.grace_period)
        _positive("server.max_concurrent_rpcs", self.max_concurrent_rpcs, optional=True)
        for name in ("max_request_bytes", "max_stop_strings", "max_stop_string_length", "max_waiting_requests",
                     "max_request_bytes_in_flight"):
            _positive(f"server.{name}", getattr(self, name))
        _check(self.max_request_bytes_in_flight >= self.max_request_bytes, "server.max_request_bytes_in_flight",
               f"at least max_request_bytes ({self.max_request_bytes}), or no request of that size is ever read",
               self.max_request_bytes_in_flight)

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    @property
    def http_enabled(self) -> bool:
        return self.http_port != 0

    def exposure_warnings(self) -> list[str]:
        """What is unsafe about listening where this config says: on a non-loopback address,
        without a token anyone who reaches the ports can generate, and without TLS the token and
        every prompt cross the network in clear text."""
        if is_loopback(self.host):
            return []
        warnings = []
        if not self.auth_token:
            warnings.append(f"listening on {self.host} with no auth_token: anyone who can reach these ports "
                            "can run generation (set --auth-token / SPECDEC_AUTH_TOKEN)")
        if not self.tls_cert:
            warnings.append(f"listening on {self.host} without TLS: the bearer token and every prompt and "
                            "completion cross the network in clear text (set --tls-cert and --tls-key)")
        return warnings


@dataclass(frozen=True)
class RayConfig:
    enabled: bool = setting(True, "run the workers and the coordinator as Ray actors (no: one process)")
    address: str | None = setting(None, "join this Ray cluster ('auto', 'head:6379'); unset: start one")
    dashboard_host: str = setting("127.0.0.1", "dashboard bind address (a Ray instance this command starts)")
    dashboard_port: int = setting(8265, "dashboard port (a Ray instance this command starts)")
    name: str = setting("specdec", "deployment name: actors <name>-target/-draft/-coordinator")
    worker_host: str | None = setting(
        None, "bind address of the worker gRPC servers: 127.0.0.1 or 'node-ip'; "
              "unset: 127.0.0.1 for a local Ray instance, node-ip with ray_address")
    worker_cpus: float = setting(1.0, "CPUs Ray reserves for each worker actor")
    max_restarts: int = setting(3, "times Ray restarts a dead actor (-1: forever)")
    worker_wait: float = setting(600.0, "seconds to wait for the target/draft worker nodes of a cluster")
    target_worker_port: int = setting(50061, "target worker port when it binds a non-loopback address")
    draft_worker_port: int = setting(50062, "draft worker port when it binds a non-loopback address")

    def __post_init__(self) -> None:
        _check(self.max_restarts >= -1, "ray.max_restarts", "an integer >= -1", self.max_restarts)
        _check(self.worker_cpus >= 0, "ray.worker_cpus", "a number >= 0", self.worker_cpus)
        for name in ("target_worker_port", "draft_worker_port", "dashboard_port"):
            port = getattr(self, name)
            _check(isinstance(port, int) and 0 <= port < 65536, f"ray.{name}", "a port number", port)


DRAFT_PLACEMENTS = ("colocated", "spread")


@dataclass(frozen=True)
class ReplicaConfig:
    """How many independent target replicas (each its own target worker, KV cache and scheduler)
    serve behind the one public endpoint, where their workers go, and when the coordinator adds or
    removes one (autoscaling: between min_replicas and max_replicas)."""

    count: int = setting(1, "target replicas at start, each with its own target worker, KV cache and scheduler")
    min_replicas: int | None = setting(None, "autoscaling: never fewer replicas than this; unset: replicas")
    max_replicas: int | None = setting(None, "autoscaling: never more replicas than this; unset: replicas "
                                             "(max > min turns autoscaling on)")
    draft_replicas: int | None = setting(None, "draft workers shared by the target replicas (replica i drafts "
                                               "with draft i mod M); unset: one per replica")
    draft_placement: str = setting("colocated", "colocated: a replica's target and draft share a node when "
                                                "they fit (Ray PACK); spread: on different nodes (SPREAD)")
    scale_up_queue: int = setting(4, "autoscaling: add a replica when every replica has more waiting "
                                     "requests than this for scale_window seconds")
    scale_window: float = setting(10.0, "autoscaling: seconds the queue must stay above scale_up_queue")
    scale_down_idle: float = setting(60.0, "autoscaling: seconds a replica must be idle before it is drained "
                                           "and removed")

    def __post_init__(self) -> None:
        _positive("replicas.replicas", self.count)
        _positive("replicas.min_replicas", self.min_replicas, optional=True)
        _positive("replicas.max_replicas", self.max_replicas, optional=True)
        _check(self.lowest <= self.count, "replicas.replicas", f"at least min_replicas ({self.lowest})",
               self.count)
        _check(self.count <= self.highest, "replicas.max_replicas", f"at least replicas ({self.count})",
               self.highest)
        _positive("replicas.draft_replicas", self.draft_replicas, optional=True)
        _check(self.draft_replicas is None or self.draft_replicas <= self.highest, "replicas.draft_replicas",
               f"at most max_replicas ({self.highest})", self.draft_replicas)
        _check(self.draft_placement in DRAFT_PLACEMENTS, "replicas.draft_placement",
               f"one of {', '.join(DRAFT_PLACEMENTS)}", self.draft_placement)
        _check(isinstance(self.scale_up_queue, int) and self.scale_up_queue >= 0, "replicas.scale_up_queue",
               "an integer >= 0", self.scale_up_queue)
        for name in ("scale_window", "scale_down_idle"):
            _check(getattr(self, name) > 0, f"replicas.{name}", "a number of seconds > 0", getattr(self, name))

    @property
    def lowest(self) -> int:
        return self.count if self.min_replicas is None else self.min_replicas

    @property
    def highest(self) -> int:
        return self.count if self.max_replicas is None else self.max_replicas

    @property
    def autoscaling(self) -> bool:
        return self.highest > self.lowest

    def draft_of(self, replica: int) -> int:
        """The draft worker replica `replica` drafts with."""
        return replica % self.draft_replicas if self.draft_replicas else replica

    def owns_draft(self, replica: int) -> bool:
        """Does replica `replica` start a draft worker (others share one)?"""
        return self.draft_of(replica) == replica
