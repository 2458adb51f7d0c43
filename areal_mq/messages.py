"""Every message that crosses a socket, defined once, typed and documented.

What: pydantic models, one per message kind, each with its direction and a docstring example.
Arrays (token ids, logprobs, versions, weight bytes) are numpy arrays; `areal_mq.protocol` moves them
as raw frames. Why: validation at every boundary — a message that does not fit its model is answered
with `Error`, never half-processed. See docs/protocol.md for the wire format.
"""
from __future__ import annotations

import enum
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

PROTOCOL_VERSION = 1
MAX_READY_TASKS = 256  # Ready.tasks entries; a worker serving more advertises none (= anything)
MAX_SESSION_LEN = 128  # GenerateRequest.session characters (a routing and cache key, never a payload)
MAX_EPISODE_TOKENS = 1 << 16  # SeqSample.loss_mask / EpisodeResult: tokens after the prompt of one episode
MAX_PROBLEM_CHARS = 1 << 16  # EpisodeJob.prompt and answer characters
MAX_PARTIAL_TOKENS = 4096  # GeneratePartial tokens in one message (a worker sends at most this many per partial)


def _narrowed(value: np.ndarray, want: np.dtype) -> np.ndarray:
    """`value` (a wider dtype of the same kind) as `want`, refused when a value does not survive: an int64 token id
    past the int32 range used to wrap silently, a float64 past the float32 range became inf (found by fuzzing)."""
    with np.errstate(over="ignore", invalid="ignore"):
        arr = value.astype(want)
    if want.kind in "iu":
        lost = not np.array_equal(arr, value)
    else:
        lost = bool((np.isinf(arr) & np.isfinite(value)).any())
    if lost:
        raise ValueError(f"values out of the {want.name} range (e.g. {value[:3].tolist()})")
    return arr


def _array_of(dtype: str):
    want = np.dtype(dtype)
    # a plain list may hold these kinds of number (ints for a float array: 0 is an int in msgpack)
    list_kinds = "iu" if want.kind in "iu" else "iuf"

    def coerce(value: Any) -> np.ndarray:
        if isinstance(value, (list, tuple)):
            try:
                value = np.asarray(value)
            except (TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"expected a list of {want.name}: {exc}") from None
            if value.size and value.dtype.kind not in list_kinds:
                raise ValueError(f"expected a list of {want.name}, got {value.dtype.name} values")
            if value.size and value.dtype != want:
                value = _narrowed(value, want)
        if isinstance(value, np.ndarray):
            if value.dtype == want:
                arr = value
            elif value.size == 0:
                arr = value.astype(want)
            elif np.can_cast(value.dtype, want, casting="same_kind") and value.dtype.kind == want.kind:
                arr = _narrowed(value, want)
            else:
                raise ValueError(f"expected a {want.name} array, got {value.dtype.name}")
        else:
            raise ValueError(f"expected a {want.name} array, got {type(value).__name__}")
        if arr.ndim != 1:
            raise ValueError(f"expected a 1-d {want.name} array, got shape {arr.shape}")
        return arr

    return Annotated[np.ndarray, BeforeValidator(coerce)]


Int32Array = _array_of("int32")
Float32Array = _array_of("float32")
UInt8Array = _array_of("uint8")


class Kind(str, enum.Enum):
    READY = "ready"
    HEARTBEAT = "heartbeat"
    DISCONNECT = "disconnect"
    GENERATE_REQUEST = "generate_request"
    GENERATE_RESULT = "generate_result"
    GENERATE_PARTIAL = "generate_partial"
    REWARD_JOB = "reward_job"
    REWARD_RESULT = "reward_result"
    SAMPLE = "sample"
    GET_BATCH = "get_batch"
    SAMPLE_BATCH = "sample_batch"
    BATCH_ACK = "batch_ack"
    ACK = "ack"
    WEIGHTS_READY = "weights_ready"
    WEIGHTS_FETCH = "weights_fetch"
    WEIGHTS_CHUNK = "weights_chunk"
    CONTROL = "control"
    EVENT = "event"
    ERROR = "error"
    STATS_REQUEST = "stats_request"
    STATS = "stats"
    EPISODE_JOB = "episode_job"
    EPISODE_RESULT = "episode_result"


class Message(BaseModel):
    """Base of every message. `kind` and `direction` are class-level facts, not fields."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=False)
    kind: ClassVar[Kind]
    direction: ClassVar[str]


# ---------------------------------------------------------------- liveness (Paranoid Pirate)
class Ready(Message):
    """worker -> job broker: I serve `service` and can hold `capacity` jobs at once.

    Sent again with capacity 0 to drain (no new jobs), and after every reconnect.
    tasks: the reward tasks (RewardJob.task) this worker can score; empty = any job of the service. The
    broker routes a reward_job only to workers whose tasks include its task (or that list none).
    Example: Ready(service="reward", capacity=4, worker_id="reward-0", role="reward", tasks=["math"])
    """

    kind: ClassVar[Kind] = Kind.READY
    direction: ClassVar[str] = "worker -> job broker"
    service: str = Field(min_length=1, max_length=64)
    capacity: int = Field(ge=0, le=100_000)
    worker_id: str = Field(min_length=1, max_length=128)
    role: str = ""
    tasks: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=list, max_length=MAX_READY_TASKS)


class Heartbeat(Message):
    """any peer <-> broker: I am alive. Brokers answer every client/worker heartbeat.

    Example: Heartbeat(peer_id="rollout-0")
    """

    kind: ClassVar[Kind] = Kind.HEARTBEAT
    direction: ClassVar[str] = "worker|client <-> broker"
    peer_id: str = ""


class Disconnect(Message):
    """worker -> job broker: I am leaving; requeue whatever of mine is still in flight.

    Example: Disconnect(reason="sigterm")
    """

    kind: ClassVar[Kind] = Kind.DISCONNECT
    direction: ClassVar[str] = "worker -> job broker"
    reason: str = ""


# ---------------------------------------------------------------- generation
class SamplingSpec(BaseModel):
    """Sampling settings of one sequence: on the wire (GenerateRequest.sampling) and inside every engine
    (EngineRequest.sampling), one type. temperature 0 means greedy.

    Stopping: at the tokenizer's EOS (unless ignore_eos), at any of stop_token_ids (the stopping token
    is kept in output_ids), when the text contains a stop string (text is cut before it), or after
    max_new_tokens. seed: a per-request random stream, so the tokens do not depend on batch mates.
    Example: SamplingSpec(temperature=0.7, max_new_tokens=64, seed=3)
    """

    model_config = ConfigDict(extra="forbid")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_new_tokens: int = 256
    stop_token_ids: list[int] = Field(default_factory=list)
    stop_strings: list[str] = Field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past the tokenizer's EOS (stop_token_ids still stop)

    def check(self) -> None:
        """Raise EngineRequestError naming the bad field (engines call this on submit)."""
        from areal_mq.errors import EngineRequestError

        if not (self.temperature >= 0.0):
            raise EngineRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise EngineRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EngineRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise EngineRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise EngineRequestError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        if any(not s for s in self.stop_strings):
            raise EngineRequestError(f"stop_strings must be non-empty strings, got {self.stop_strings}")


class GenerateRequest(Message):
    """controller -> job broker (service "generate") -> rollout worker: generate one sequence.

    prompt_ids  # [P] int32, chat template already applied
    min_version: the controller's current policy version; a worker that has not loaded it yet holds the
    request until it has (otherwise a request racing its WeightsReady would be generated stale).
    pin_version: None (a training request), or the one policy version this request may be generated at: a
    periodic evaluation through the rollout engines (eval.via rollout) pins its requests to the version it
    evaluates. A worker below it holds the request until it loads exactly that version; while pinned requests
    run it applies no newer version (training requests meanwhile are generated at the pinned one); a worker
    already past it answers Error(version_passed), not retryable. min_version <= pin_version; only the
    controller submits these, and their answers never reach the sample store.
    session: the multi-turn episode this request is a turn of ("" = none), at most MAX_SESSION_LEN chars.
    Every turn of one episode carries the same key: the job broker sends it to the worker that served the
    session last (that worker may still hold the previous turn's KV), and the torch engine reuses that KV
    when this prompt extends the previous turn's tokens. A hint only: results never depend on it.
    Example: GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingSpec(max_new_tokens=64),
                             group_id="p17-e0", sample_index=3, session="p17-e0-s3")
    """

    kind: ClassVar[Kind] = Kind.GENERATE_REQUEST
    direction: ClassVar[str] = "controller -> rollout worker"
    prompt_ids: Int32Array
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    group_id: str = ""
    sample_index: int = 0
    min_version: int = Field(0, ge=0, description="Start only once the worker's policy is at least this version.")
    pin_version: int | None = Field(None, ge=0, le=2**31 - 1, description="Generate only at exactly this policy "
                                    "version (a periodic evaluation); None: any version >= min_version.")
    session: str = Field("", max_length=MAX_SESSION_LEN,
                         description="Multi-turn episode key: sticky routing and KV reuse across turns.")
    stream: bool = Field(False, description="Send GeneratePartial messages while decoding (the OpenAI endpoint's "
                         "stream: true); the GenerateResult stays the answer. Training traffic leaves it False.")
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _pin_not_below_min(self) -> "GenerateRequest":
        if self.pin_version is not None and self.pin_version < self.min_version:
            raise ValueError(f"pin_version {self.pin_version} is below min_version {self.min_version}: no version "
                             "can serve the request")
        return self


def same_token_lengths(msg: Any) -> Any:
    """A message's output_ids, logprobs and versions must have one length (one entry per generated token)."""
    n = len(msg.output_ids)
    if len(msg.logprobs) != n or len(msg.versions) != n:
        raise ValueError(f"array length mismatch: output_ids {n}, logprobs {len(msg.logprobs)}, "
                         f"versions {len(msg.versions)} (all must be equal)")
    return msg


class GenerateResult(Message):
    """rollout worker -> job broker -> controller: one finished sequence.

    output_ids  # [T] int32
    logprobs    # [T] float32, behaviour logprob (temperature-scaled, before top-p/top-k)
    versions    # [T] int32, policy version that sampled each token
    Example: GenerateResult(output_ids=[5, 6], logprobs=[-0.1, -2.0], versions=[3, 4],
                            finish_reason="stop", text="42", worker_id="rollout-0")
    """

    kind: ClassVar[Kind] = Kind.GENERATE_RESULT
    direction: ClassVar[str] = "rollout worker -> controller"
    output_ids: Int32Array
    logprobs: Float32Array
    versions: Int32Array
    finish_reason: Literal["stop", "length", "abort"]
    text: str = ""
    worker_id: str = ""
    group_id: str = ""
    sample_index: int = 0
    stats: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _same_lengths(self) -> "GenerateResult":
        return same_token_lengths(self)


class GeneratePartial(Message):
    """rollout worker -> job broker -> requester: tokens of a streamed request (GenerateRequest.stream) decoded
    since the previous partial, sent while the sequence runs. A view only: the GenerateResult that ends the job is
    the answer and holds every token again; a requester may drop partials (the broker forwards them only from the
    worker the job is assigned to, only for a generate_request, and only the rollout role may send them).

    output_ids  # [K] int32, 1 <= K <= MAX_PARTIAL_TOKENS, the tokens after the first `start`
    logprobs    # [K] float32
    versions    # [K] int32, the policy version of each (a weight update mid-answer changes them; same stream)
    seq: 0, 1, 2, ... per job (a gap or repeat means a partial was lost or the job was requeued: `start` says
    where these tokens belong; a requeued job starts again at 0).
    Rate: at most one per job every STREAM_INTERVAL_S, each at most MAX_PARTIAL_TOKENS (workers/rollout_stream.py).
    Example: GeneratePartial(output_ids=[5, 6], logprobs=[-0.1, -2.0], versions=[3, 3], start=0, seq=0)
    """

    kind: ClassVar[Kind] = Kind.GENERATE_PARTIAL
    direction: ClassVar[str] = "rollout worker -> requester"
    output_ids: Int32Array
    logprobs: Float32Array
    versions: Int32Array
    start: int = Field(ge=0, le=1 << 20)
    seq: int = Field(ge=0, le=1 << 20)

    @model_validator(mode="after")
    def _bounded(self) -> "GeneratePartial":
        if not 1 <= len(self.output_ids) <= MAX_PARTIAL_TOKENS:
            raise ValueError(f"a partial holds 1 to MAX_PARTIAL_TOKENS ({MAX_PARTIAL_TOKENS}) tokens, got "
                             f"{len(self.output_ids)}")
        return same_token_lengths(self)


# ---------------------------------------------------------------- rewards
class RewardJob(Message):
    """controller -> job broker (service "reward") -> reward worker: score completions of one prompt.

    `completions` holds one completion (per-sample functions) or the whole group (group functions).
    Example: RewardJob(task="math", prompt_id="p17", prompt="2+3?", completions=["\\boxed{5}"],
                       reference="5")
    """

    kind: ClassVar[Kind] = Kind.REWARD_JOB
    direction: ClassVar[str] = "controller -> reward worker"
    task: str = Field(min_length=1)
    prompt_id: str = ""
    prompt: str = ""
    completions: list[str] = Field(min_length=1)
    reference: Any = None
    truncated: list[bool] = Field(default_factory=list)
    lengths: list[int] = Field(default_factory=list)  # each completion's generated tokens (DAPO's length shaping)
    max_tokens: int = Field(0, ge=0)  # the generation cap those lengths ran against (controller.max_new_tokens)
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_flag_per_completion(self) -> "RewardJob":
        for name in ("truncated", "lengths"):
            values = getattr(self, name)
            if values and len(values) != len(self.completions):
                what = "flags" if name == "truncated" else "entries"
                raise ValueError(f"{name} has {len(values)} {what} for {len(self.completions)} "
                                 "completions (one per completion, or none)")
        if any(n < 0 for n in self.lengths):
            raise ValueError("lengths must be token counts (>= 0)")
        return self


class RewardResult(Message):
    """reward worker -> controller: one reward per completion, same order as the job.

    Example: RewardResult(rewards=[1.0], details=[{"correct": True}], errors=[None])
    """

    kind: ClassVar[Kind] = Kind.REWARD_RESULT
    direction: ClassVar[str] = "reward worker -> controller"
    rewards: list[float]
    details: list[dict[str, Any]] = Field(default_factory=list)
    errors: list[str | None] = Field(default_factory=list)
    cached: bool = False
    worker_id: str = ""


# ---------------------------------------------------------------- samples
class SeqSample(BaseModel):
    """One rewarded sequence inside a Sample group (a single answer, or a whole multi-turn episode).

    prompt_ids  # [P] int32;  output_ids/logprobs/versions  # [T]
    loss_mask   # [T] uint8 or None: 1 = a model-generated token (trained), 0 = an environment token inside
                # the episode (feedback, tool output: version -1, logprob 0, never trained). None = every
                # output token was generated (single-turn; today's behaviour).
    loss_excluded  # True: no token of this sequence is trained (DAPO's overlong filtering of a truncated
                # answer, controller.overlong_filter), while its reward still counts in its group's advantages.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    prompt_ids: Int32Array
    output_ids: Int32Array
    logprobs: Float32Array
    versions: Int32Array
    reward: float
    finish_reason: str = "stop"
    info: dict[str, Any] = Field(default_factory=dict)
    loss_mask: UInt8Array | None = None
    loss_excluded: bool = False

    @model_validator(mode="after")
    def _same_lengths(self) -> "SeqSample":
        same_token_lengths(self)
        if self.loss_mask is not None:
            check_loss_mask(self.loss_mask, self.versions)
        return self


def check_loss_mask(mask: np.ndarray, versions: np.ndarray) -> None:
    """A loss mask has one 0/1 per output token (at most MAX_EPISODE_TOKENS); trained tokens carry a real
    policy version (>= 0) and environment tokens version -1, so staleness never counts an environment token."""
    if len(mask) != len(versions):
        raise ValueError(f"loss_mask has {len(mask)} entries for {len(versions)} output tokens (one per token)")
    if len(mask) > MAX_EPISODE_TOKENS:
        raise ValueError(f"{len(mask)} output tokens exceed MAX_EPISODE_TOKENS ({MAX_EPISODE_TOKENS})")
    if mask.size and int(mask.max()) > 1:
        raise ValueError("loss_mask entries must be 0 (environment token) or 1 (generated token)")
    gen = mask.astype(bool)
    if (versions[gen] < 0).any() or (versions[~gen] != -1).any():
        raise ValueError("generated tokens (mask 1) need versions >= 0 and environment tokens (mask 0) version -1")


class Sample(Message):
    """controller -> sample store: one finished, rewarded group (all n samples of one prompt).

    Answered with Ack. Example: Sample(sample_id="p17-e0", prompt_id="p17", seqs=[SeqSample(...)])
    """

    kind: ClassVar[Kind] = Kind.SAMPLE
    direction: ClassVar[str] = "controller -> sample store"
    sample_id: str = Field(min_length=1)
    prompt_id: str = ""
    seqs: list[SeqSample] = Field(min_length=1)
    meta: dict[str, Any] = Field(default_factory=dict)

    def oldest_version(self) -> int:
        """Smallest policy version among generated tokens (-1 if nothing was generated). Environment tokens of
        an episode (version -1) are not generated: an episode is as stale as its oldest GENERATED token."""
        mins = [int(v.min()) for s in self.seqs if len(v := s.versions[s.versions >= 0])]
        return min(mins) if mins else -1


def length_bucket(longest_output: int, width: int = 32) -> str:
    """The bucket that drop reports count a group in, by its longest completion: 40 -> "32-63". The store's
    staleness drops and the controller's uniform-reward drops use the same buckets, so length bias shows."""
    low = longest_output // width * width
    return f"{low}-{low + width - 1}"


class GetBatch(Message):
    """trainer -> sample store: give me `n_samples` groups no older than version - max_staleness.

    `release_leases` hands back every batch served earlier and not acked (a restarted trainer).
    `skip_ids` are acked before serving; the header limit (4 MiB) bounds them, so long lists go as BatchAcks.
    `timeout_ms` is cut to the store's brokers.store_max_wait_ms.
    Example: GetBatch(n_samples=8, version=3, max_staleness=2, timeout_ms=30000)
    """

    kind: ClassVar[Kind] = Kind.GET_BATCH
    direction: ClassVar[str] = "trainer -> sample store"
    n_samples: int = Field(ge=1)
    version: int = Field(ge=0)
    max_staleness: int | None = Field(default=None, ge=0)
    timeout_ms: int = Field(default=0, ge=0)
    release_leases: bool = False
    skip_ids: list[str] = Field(default_factory=list)


class SampleBatch(Message):
    """sample store -> trainer: a batch to train on; ack it with BatchAck after the step.

    Example: SampleBatch(batch_id="b3", samples=[...], dropped_stale=1)
    """

    kind: ClassVar[Kind] = Kind.SAMPLE_BATCH
    direction: ClassVar[str] = "sample store -> trainer"
    batch_id: str
    samples: list[Sample]
    dropped_stale: int = 0


class BatchAck(Message):
    """trainer -> sample store: these samples were trained on; never serve them again.

    Example: BatchAck(batch_id="b3", sample_ids=["p17-e0"])
    """

    kind: ClassVar[Kind] = Kind.BATCH_ACK
    direction: ClassVar[str] = "trainer -> sample store"
    batch_id: str = ""
    sample_ids: list[str] = Field(default_factory=list)


class Ack(Message):
    """broker/store -> client: the message `ref_id` was accepted (stored, acked, ...).

    Example: Ack(ref_id="3f2a...", info={"duplicate": False})
    """

    kind: ClassVar[Kind] = Kind.ACK
    direction: ClassVar[str] = "broker|store -> client"
    ref_id: str = ""
    info: dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------- weights and signals
MAX_WEIGHT_LINKS = 4096  # WeightsReady.links entries (a chain is bounded by trainer.full_every)


class WeightsLink(BaseModel):
    """One fetchable piece of a published version, as listed in WeightsReady.links.

    base -1: the full `version`; base >= 0: the delta taking version `base` to `version` (always version - 1).
    chunks: WeightsChunk count (zmq; 0 on disk); bytes: its size on the wire or on disk.
    Example: WeightsLink(version=5, base=4, chunks=1, bytes=812_044)
    """

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)
    base: int = Field(-1, ge=-1)
    chunks: int = Field(0, ge=0)
    bytes: int = Field(0, ge=0)


MAX_WEIGHT_SHARDS = 4096  # WeightsReady.shards: trainer ranks publishing their own slices
MAX_SHARD_SLICES = 1 << 16  # WeightsShard slices: tensors one rank serves (a 70B model has ~730 tensors)


class WeightsAdapter(BaseModel):
    """What a LoRA publication carries beside its tensors (trainer.lora, areal_mq/algorithms/lora.py), as
    WeightsReady.adapter. The version's tensors are then the adapter only, named `<module>.lora_A.weight` [rank, in]
    and `<module>.lora_B.weight` [out, rank] by the base model's module paths; they travel like any version (disk,
    zmq, deltas, checksums). A receiver computes W = W_base + scaling * B @ A for every named module from the base
    it was started with (never from the previous version), or hands the adapter to an engine that serves adapters
    (vLLM's LoRA API) under the name `areal-v<version>`. `base_checksum` names the base the adapter was trained on;
    a worker whose base differs refuses the version.
    Example: WeightsAdapter(rank=16, alpha=32.0, target_modules=["q_proj", "v_proj"], base_checksum="3f9a...c2")
    """

    model_config = ConfigDict(extra="forbid")
    rank: int = Field(ge=1, le=1024)
    alpha: float = Field(gt=0, le=1e6)
    target_modules: list[Annotated[str, Field(max_length=64)]] | Literal["all-linear"] = Field("all-linear", max_length=32)
    base_checksum: str = Field("", pattern=r"^([0-9a-f]{16,64})?$")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class WeightsShard(BaseModel):
    """One trainer rank's part of a sharded publish (trainer.publish_layout sharded), as listed in WeightsReady.shards.

    The rank serves its slices of the model from its own weight server at `endpoint`, like an unsharded server
    serves the whole model: `num_chunks` full chunks of `version`, a delta from `base` of `delta_chunks` chunks, and
    `links` for the catch-up (areal_mq/weights/catchup.py), all counted over this rank's slices only.
    Slice i: rows starts[i] .. starts[i] + rows[i] along dimension 0 of tensor names[i], whose whole shape is
    shapes[i] (a 0-dim tensor: start 0, rows 0, served whole by one rank); checksums[i] is the blake2b-128 hex of
    the slice's bytes in the published dtype. Every tensor's slices over all shards tile its dimension 0 exactly.
    Example: WeightsShard(rank=1, endpoint="tcp://10.0.0.2:5602", num_chunks=2, names=["lm_head.weight"],
                          starts=[24576], rows=[24576], shapes=[[49152, 576]], checksums=["9f2c...e1"])
    """

    model_config = ConfigDict(extra="forbid")
    rank: int = Field(ge=0, lt=MAX_WEIGHT_SHARDS)
    endpoint: str = Field(max_length=256)
    num_chunks: int = Field(0, ge=0)
    base: int = Field(-1, ge=-1)
    delta_chunks: int = Field(0, ge=0)
    bytes: int = Field(0, ge=0)
    links: list[WeightsLink] = Field(default_factory=list, max_length=MAX_WEIGHT_LINKS)
    names: list[str] = Field(default_factory=list, max_length=MAX_SHARD_SLICES)
    starts: list[int] = Field(default_factory=list, max_length=MAX_SHARD_SLICES)
    rows: list[int] = Field(default_factory=list, max_length=MAX_SHARD_SLICES)
    shapes: list[list[int]] = Field(default_factory=list, max_length=MAX_SHARD_SLICES)
    checksums: list[str] = Field(default_factory=list, max_length=MAX_SHARD_SLICES)

    @model_validator(mode="after")
    def _check_slices(self) -> "WeightsShard":
        n = len(self.names)
        if any(len(x) != n for x in (self.starts, self.rows, self.shapes, self.checksums)):
            raise ValueError(f"names, starts, rows, shapes and checksums must have one entry per slice ({n})")
        for name, start, rows, shape in zip(self.names, self.starts, self.rows, self.shapes):
            if len(shape) > 8 or any(d < 0 for d in shape) or start < 0 or rows < 0:
                raise ValueError(f"slice of {name!r}: start {start}, rows {rows} and shape {shape} must be "
                                 "non-negative (at most 8 dimensions)")
            if (not shape and (start or rows)) or (shape and start + rows > shape[0]):
                raise ValueError(f"slice of {name!r}: rows {start}..{start + rows} exceed its shape {shape}")
        return self


class WeightsReady(Message):
    """trainer -> signal bus (topic "weights") -> rollout workers: policy `version` is published.

    mode "disk": safetensors dir at `path`; "zmq": fetch from `endpoint` with WeightsFetch;
    "base": the initial model, nothing to fetch; "sim": a simulated trainer's version (trainer.sim), no weights
    exist: a simulated engine models the load pause, any other engine refuses it. "cuda_ipc": the trainer's shared
    buffers (handle set `ipc_set`, described once in run_dir/ipc/<ipc_set>.json) now hold `version`; a colocated
    worker copies them device to device (areal_mq/weights/ipc.py).
    Deltas (trainer.weight_deltas, areal_mq/weights/delta.py): `base` >= 0 says a delta from version `base`
    (= version - 1) exists: `delta_chunks` chunks (zmq) or `path`/model.delta (disk). `links` lists every piece
    the trainer still holds that leads to `version` — full versions (base -1) and the chain of deltas after the
    newest of them — so a worker not at `base` picks the fewest bytes (its own version + deltas, a full version
    + deltas, or the full current version). base -1 and no links: full weights only (deltas off).
    Sharded (trainer.publish_layout sharded, areal_mq/weights/sharded.py): `shards` lists every trainer rank's
    weight server and the slices it holds (WeightsShard); a worker fetches from all of them at once and assembles
    the tensors. `endpoint` is then rank 0's server; `links`/`base` are empty/-1 (each shard has its own).
    Adapter (trainer.lora): `adapter` set says the tensors are a LoRA adapter to apply to the base (WeightsAdapter).
    Example: WeightsReady(version=4, mode="disk", path="/runs/r1/weights/v4")
    Example: WeightsReady(version=5, mode="zmq", endpoint="tcp://10.0.0.2:5601", num_chunks=3, base=4,
                          delta_chunks=1, links=[WeightsLink(version=4, chunks=3, bytes=270_000_000),
                          WeightsLink(version=5, chunks=3, bytes=270_000_000),
                          WeightsLink(version=5, base=4, chunks=1, bytes=812_044)])
    """

    kind: ClassVar[Kind] = Kind.WEIGHTS_READY
    direction: ClassVar[str] = "trainer -> rollout workers"
    version: int = Field(ge=0)
    mode: Literal["disk", "zmq", "base", "sim", "cuda_ipc"] = "disk"
    path: str = ""
    ipc_set: str = Field("", pattern=r"^([0-9a-f]{32})?$")  # cuda_ipc: run_dir/ipc/<ipc_set>.json (weights/ipc.py)
    endpoint: str = ""
    num_chunks: int = 0
    base: int = Field(-1, ge=-1)  # the version this version's delta applies to; -1: no delta
    delta_chunks: int = Field(0, ge=0)  # zmq: chunks of that delta
    links: list[WeightsLink] = Field(default_factory=list, max_length=MAX_WEIGHT_LINKS)
    shards: list[WeightsShard] = Field(default_factory=list, max_length=MAX_WEIGHT_SHARDS)
    adapter: WeightsAdapter | None = None  # a LoRA publication: the tensors are the adapter only (WeightsAdapter)
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_delta(self) -> "WeightsReady":
        if self.adapter is not None and self.mode not in ("disk", "zmq"):
            raise ValueError(f"an adapter WeightsReady travels by disk or zmq, got mode {self.mode!r}")
        if self.shards and self.mode != "zmq":
            raise ValueError(f"a sharded WeightsReady (shards) is served over zmq, got mode {self.mode!r}")
        if len({s.rank for s in self.shards}) != len(self.shards):
            raise ValueError("WeightsReady.shards names a rank twice")
        if sum(len(s.names) for s in self.shards) > 4 * MAX_SHARD_SLICES:
            raise ValueError(f"WeightsReady.shards list more than {4 * MAX_SHARD_SLICES} slices")
        if self.base >= self.version:
            raise ValueError(f"a delta's base ({self.base}) must be older than its version ({self.version})")
        if any(link.version > self.version or link.base >= link.version for link in self.links):
            raise ValueError("links name versions up to this one, each delta from an older base")
        return self


class WeightsFetch(Message):
    """rollout worker -> trainer weight server: send me chunk `index` of `version` — of its full weights
    (base -1), or of its delta from version `base` (a WeightsLink of the announcement).

    Example: WeightsFetch(version=4, index=0)
    Example: WeightsFetch(version=5, index=0, base=4)
    """

    kind: ClassVar[Kind] = Kind.WEIGHTS_FETCH
    direction: ClassVar[str] = "rollout worker -> trainer"
    version: int = Field(ge=0)
    index: int = Field(ge=0)
    base: int = Field(-1, ge=-1)


class WeightsChunk(Message):
    """trainer weight server -> rollout worker: some tensors of `version`, full (base -1) or as deltas from
    version `base`.

    tensors  # list of [nbytes] uint8: raw little-endian storage of a tensor (full), or a zstd delta frame
    encodings  # per tensor: "raw" (full; also when empty), "sparse" or "xor" (weights/delta.py)
    counts  # per tensor: changed elements of a sparse delta, else 0 (empty: all 0)
    checksums  # per tensor: blake2b-128 hex of the RESULTING tensor's bytes (empty: unchecked, older servers)
    Example: WeightsChunk(version=4, index=0, total=3, names=["lm_head.weight"],
                          dtypes=["bfloat16"], shapes=[[49152, 576]], tensors=[...])
    Example: WeightsChunk(version=5, index=0, total=1, base=4, names=["lm_head.weight"], dtypes=["bfloat16"],
                          shapes=[[49152, 576]], tensors=[...], encodings=["xor"], counts=[0],
                          checksums=["9f2c...e1"])
    """

    kind: ClassVar[Kind] = Kind.WEIGHTS_CHUNK
    direction: ClassVar[str] = "trainer -> rollout worker"
    version: int
    index: int
    total: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    tensors: list[UInt8Array]
    base: int = Field(-1, ge=-1)
    encodings: list[str] = Field(default_factory=list)
    counts: list[int] = Field(default_factory=list)
    checksums: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_lengths(self) -> "WeightsChunk":
        n = len(self.names)
        if len(self.dtypes) != n or len(self.shapes) != n or len(self.tensors) != n or \
                any(len(x) not in (0, n) for x in (self.encodings, self.counts, self.checksums)):
            raise ValueError(f"names, dtypes, shapes, tensors (and encodings, counts, checksums when given) "
                             f"must have one entry per tensor ({n})")
        return self


class Control(Message):
    """anyone -> signal bus (topic "control") -> every worker: pause, resume, shutdown, checkpoint.

    Example: Control(action="shutdown", reason="run finished")
    """

    kind: ClassVar[Kind] = Kind.CONTROL
    direction: ClassVar[str] = "launcher|controller -> workers"
    action: Literal["pause", "resume", "shutdown", "checkpoint"]
    reason: str = ""
    target_role: str = ""


class Event(Message):
    """every process -> signal bus (topic "events"): one structured log event.

    Example: Event(record={"event": "rollout.request_finished", "role": "rollout", "tokens": 87})
    """

    kind: ClassVar[Kind] = Kind.EVENT
    direction: ClassVar[str] = "any -> signal bus"
    record: dict[str, Any]


class Error(Message):
    """anyone -> sender: your message `ref_id` was refused or failed; `code` says why.

    codes: bad_frames, bad_header, bad_version, unknown_kind, bad_fields, bad_arrays, too_large,
    queue_full, no_service, job_failed, bad_request, bad_reply, forbidden, weights_unavailable, store_full,
    disk_full, internal, version_passed. version_passed: a pinned GenerateRequest reached a worker already past
    its version.
    Example: Error(code="bad_version", message="protocol version 9, this broker speaks 1", ref_id="")
    """

    kind: ClassVar[Kind] = Kind.ERROR
    direction: ClassVar[str] = "any -> sender"
    code: str
    message: str
    ref_id: str = ""


# ---------------------------------------------------------------- multi-turn episodes (areal_mq/workflows)
class EpisodeJob(Message):
    """controller -> job broker (service "agent") -> agent worker: run one episode of the agent's workflow.

    The workflow is the code the agent's operator named (--workflow / agent.workflow); nothing here selects
    code. prompt_ids  # [P] int32, the problem's chat-templated first prompt (the controller's formatter).
    episode_id is also the `session` of every turn's GenerateRequest (sticky routing, KV reuse).
    Example: EpisodeJob(episode_id="g0000003-p17-e1", group_id="g0000003-p17", sample_index=1,
                        problem_id="p17", prompt="What is 2 + 3?", answer="5", prompt_ids=[1, 2, 3])
    """

    kind: ClassVar[Kind] = Kind.EPISODE_JOB
    direction: ClassVar[str] = "controller -> agent worker"
    episode_id: str = Field(min_length=1, max_length=MAX_SESSION_LEN)
    group_id: str = Field("", max_length=256)
    sample_index: int = Field(0, ge=0)
    problem_id: str = Field("", max_length=256)
    prompt: str = Field("", max_length=MAX_PROBLEM_CHARS)
    answer: str = Field("", max_length=MAX_PROBLEM_CHARS)
    level: int = 0
    prompt_ids: Int32Array
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    min_version: int = Field(0, ge=0)


class EpisodeResult(Message):
    """agent worker -> job broker -> controller: one finished episode as ONE trained sequence.

    seq: prompt_ids = the first prompt; output_ids/logprobs/versions/loss_mask = every later token in order,
    model turns (mask 1, their versions and behaviour logprobs) and environment turns (mask 0, version -1,
    logprob 0); seq.reward is the workflow's reward. turns: model turns generated.
    Example: EpisodeResult(seq=SeqSample(prompt_ids=[1, 2], output_ids=[5, 9, 6], logprobs=[-0.1, 0, -0.3],
                                         versions=[3, -1, 4], loss_mask=[1, 0, 1], reward=0.5), turns=2)
    """

    kind: ClassVar[Kind] = Kind.EPISODE_RESULT
    direction: ClassVar[str] = "agent worker -> controller"
    seq: SeqSample
    turns: int = Field(0, ge=0, le=10_000)
    worker_id: str = Field("", max_length=128)


class StatsRequest(Message):
    """client -> broker: report your queues, workers and counters. Answered with Stats."""

    kind: ClassVar[Kind] = Kind.STATS_REQUEST
    direction: ClassVar[str] = "client -> broker"


class Stats(Message):
    """broker -> client: counters. Example: Stats(data={"workers": 3, "queued": {"generate": 0}})"""

    kind: ClassVar[Kind] = Kind.STATS
    direction: ClassVar[str] = "broker -> client"
    data: dict[str, Any] = Field(default_factory=dict)


MESSAGE_TYPES: dict[Kind, type[Message]] = {
    cls.kind: cls
    for cls in (
        Ready, Heartbeat, Disconnect, GenerateRequest, GenerateResult, GeneratePartial, RewardJob, RewardResult,
        Sample, GetBatch, SampleBatch, BatchAck, Ack, WeightsReady, WeightsFetch, WeightsChunk,
        Control, Event, Error, StatsRequest, Stats, EpisodeJob, EpisodeResult,
    )
}
