"""Training configuration: pydantic models (unknown keys and wrong types rejected, the field named).

A config is a YAML file; ``--set a.b=value`` overrides fields (values parsed as YAML scalars). Relative
data paths in a config file resolve against the config file's directory (a config beside its data works
from anywhere); a ``--set data.source=`` path resolves against the working directory; ``fetched:NAME`` is a
dataset of ``grstack data fetch``.
"""

from __future__ import annotations

import os
import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from grstack.runtime.errors import UserError

DataFormat = Literal["parquet", "recbole", "seqtxt", "movielens", "kuairand", "synth"]


def _kinds(annotation: Any) -> set[type]:
    """The plain types a field annotation accepts (``int | None`` -> {int, NoneType}; a Literal's values')."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return set().union(*(_kinds(a) for a in get_args(annotation)))
    if origin is Literal:
        return {type(a) for a in get_args(annotation)}
    if annotation is None:
        return {type(None)}
    return {annotation} if isinstance(annotation, type) else set()


_NUMBERS = {int, float, type(None)}
_EXPONENT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")
_WORDS = {int: "an integer", float: "a number", bool: "true or false"}


def _strict_problem(value: Any, annotation: Any) -> str | None:
    """Why ``value`` is the wrong kind for ``annotation`` where pydantic's lax mode would cast it: a boolean
    for a number (``true`` as 1), a number for a boolean, a string for a number or boolean."""
    if get_origin(annotation) is list and isinstance(value, list):
        return next((p for p in (_strict_problem(v, get_args(annotation)[0]) for v in value) if p), None)
    kinds = _kinds(annotation)
    if not kinds or str in kinds or not kinds <= _NUMBERS | {bool}:
        return None
    want = " or ".join(_WORDS[k] for k in (int, float, bool) if k in kinds)
    if isinstance(value, bool):
        return None if bool in kinds else f"expected {want}, got {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"expected {want}, got {value!r}" if kinds.isdisjoint({int, float}) else None
    if isinstance(value, str):
        if float in kinds and _EXPONENT.fullmatch(value.strip()):
            return None  # 1e-3: a number YAML 1.1 reads as a string
        return f"expected {want}, got the string {value!r}"
    return None


class _Strict(BaseModel):
    """Unknown keys refused; no casts between booleans, numbers and strings; no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_casts(cls, value: Any, info: ValidationInfo) -> Any:
        problem = _strict_problem(value, cls.model_fields[info.field_name].annotation) if info.field_name else None
        if problem:
            raise ValueError(problem)
        return value


RATING_FORMATS = ("recbole", "movielens")


class DataConfig(_Strict):
    format: DataFormat = "synth"
    source: str = Field("tiny", description="a path (file/dir) for imports and parquet; the preset for synth")
    seed: int = Field(0, ge=0, description="seed of the synthetic generator")
    min_len: int = Field(3, ge=3, description="users with fewer events are dropped (leave-one-out needs 3)")
    max_len: int = Field(50, ge=2, description="most recent history tokens the model reads")
    read: Literal["all", "shard"] = Field(
        "all", description="all: every rank reads the whole dataset; shard: each rank reads only its share of "
        "a Parquet dataset's row groups, streamed (format parquet only)")
    shuffle_window: int = Field(8, ge=1, description="read=shard: pieces (row groups) whose rows are shuffled "
                                "together each epoch; a rank holds about twice this many decoded")
    item_features: list[str] = Field(
        default_factory=list, description="item side-feature fields the model embeds (categorical, multi-valued: "
        "categories, brands, genres, tags; docs/features.md). Imports read them from the source's side file "
        "(data.item_features_file); a Parquet dataset from its stored features. Empty: item ids only")
    item_features_file: str = Field(
        "auto", description="imports with data.item_features: the side file (RecBole .item, S3-Rec "
        "_item2attributes.json, KuaiRand video_features_basic CSV); auto: the one beside data.source")

    user_features: list[str] = Field(
        default_factory=list, description="user side-feature fields (age, gender, ...) that become contextual "
        "tokens at the head of every sequence, one per field (docs/features.md); read like item_features, from "
        "data.user_features_file. Not with data.read=shard")
    user_features_file: str = Field(
        "auto", description="imports with data.user_features: the side file (RecBole .user, KuaiRand "
        "user_features CSV, MovieLens u.user); auto: the one beside data.source")

    rating_actions: bool = Field(
        False, description="imports with ratings (recbole's rating field, movielens): each event's rating becomes "
        "its action bits, one per rating level (rating_1 ... rating_5), for model.action_inputs (docs/features.md)")
    timestamp_unit: Literal["auto", "s", "ms", "us"] = Field(
        "auto", description="imports: the unit of the source's times, stored as Unix seconds (auto: detected, "
        "refusing a file no unit fits; kuairand's time_ms is ms); as `grstack data import --timestamp-unit`")

    @field_validator("item_features", "user_features")
    @classmethod
    def _unique_fields(cls, v: list[str]) -> list[str]:
        dup = sorted({n for n in v if v.count(n) > 1})
        if dup:
            raise ValueError(f"names a field more than once: {', '.join(dup)}")
        return v

    @model_validator(mode="after")
    def _check_ratings(self) -> DataConfig:
        if self.rating_actions and self.format not in RATING_FORMATS:
            raise ValueError(f"rating_actions reads ratings at import (formats {', '.join(RATING_FORMATS)}); "
                             f"format {self.format} has none to read (a parquet dataset keeps the actions it "
                             "was imported with: `grstack data import --rating-actions`)")
        return self


class ModelConfig(_Strict):
    type: Literal["hstu", "fuxi", "sasrec"] = Field(
        "hstu", description="hstu; fuxi: FuXi-α (HSTU's model with FuXi-α's multi-channel attention and "
        "multi-stage FFN, docs/fuxi.md); sasrec: the baseline")
    d_model: int = Field(64, ge=8)
    num_blocks: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    dqk: int = Field(16, ge=1, description="per-head query/key size (HSTU)")
    dv: int = Field(16, ge=1, description="per-head value size (HSTU)")
    dropout: float = Field(0.5, ge=0.0, lt=1.0)
    input_dropout: float = Field(0.5, ge=0.0, lt=1.0)
    time_buckets: int = Field(128, ge=1)
    position_bias: bool = True
    time_bias: bool = True
    time_bias_query: Literal["self", "next"] = Field(
        "self", description="time bias (HSTU's, and FuXi-α's temporal channel): self: bucket(|ts_i - ts_j|), "
        "query token i's own time; next: "
        "bucket(ts_next(i) - ts_j), the time of the event after token i (the moment being predicted, Meta's "
        "convention; the last history token uses the first candidate's time, or its own without candidates). "
        "next cannot be served from cached prefixes")
    ranking_head: bool = Field(True, description="HSTU: train the candidate ranking head too")
    ffn_mult: int = Field(1, ge=1, description="SASRec: feed-forward width multiplier; fuxi: the "
                          "SwiGLU stage's hidden width as a multiple of d_model (FuXi-α's ffn_multiply)")
    action_inputs: bool = Field(
        False, description="embed each history token's own actions (the dataset's action bits: click, like, ...) "
        "into it; candidates get a 'to be predicted' vector instead, so the ranking head never sees its label "
        "(docs/features.md)")


class LossConfig(_Strict):
    negatives: int = Field(512, ge=1, description="sampled negatives per token (R); ignored with full_softmax")
    full_softmax: bool = Field(False, description="every item of the catalogue is a negative (the target's own "
                               "logit counted once): softmax cross-entropy over all items, the loss of RecBole's "
                               "CE, SASRec-CE and BSARec results, instead of sampled negatives. Needs "
                               "loss.sharing=batch (one set, the catalogue, for the whole batch)")
    temperature: float = Field(0.05, gt=0.0)
    sharing: Literal["batch", "group", "token"] = Field(
        "group", description="batch: one negative set for all tokens of a batch; group: one set per "
        "loss.group_size consecutive tokens; token: one set per token")
    group_size: int = Field(16, ge=1, description="tokens sharing one negative set when sharing=group")
    ranking_candidates: int = Field(8, ge=2, description="candidates per user for the ranking head (1 positive "
                                    "with ranking_on=uniform; the block of logged exposures with exposures)")
    ranking_weight: float = Field(0.1, ge=0.0)
    ranking_on: Literal["uniform", "exposures"] = Field(
        "uniform", description="what the ranking head is trained and evaluated on. uniform: the logged next "
        "event against ranking_candidates - 1 uniform items (task 'next', and the event's actions; uniform items "
        "are 0 for every task). exposures: blocks of ranking_candidates logged events with their own action "
        "labels (HSTU's ranking: the impressions a user was shown), the action tasks only; the last three "
        "blocks of every user are training's, validation's and test's, and users need 3 blocks + 2 events "
        "(docs/features.md)")


class OptimConfig(_Strict):
    lr: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.98, ge=0.0, lt=1.0)
    warmup_steps: int = Field(0, ge=0, description="optimizer updates of linear warm-up from 0 to lr")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="after warm-up: constant, or cosine / linear decay to min_lr_ratio·lr at the "
        "last optimizer update")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="the decay's floor, as a fraction of lr")
    grad_clip: float | None = Field(None, gt=0.0, description="clip dense and item-table gradients together "
                                    "to this global norm")


class TrainSection(_Strict):
    batch_size: int = Field(128, ge=1)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps in total")
    seed: int = Field(0, ge=0)
    device: str = "auto"
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: autocast the dense compute to bfloat16 (weights, optimizer state, item table "
        "and loss stay fp32)")
    tf32: bool = Field(False, description="CUDA: let fp32 matmuls and convolutions use TF32 tensor cores")
    grad_accum_steps: int = Field(1, ge=1, description="batches whose gradients are summed into one optimizer "
                                  "update (the update's batch is grad_accum_steps x batch_size)")
    num_threads: int | None = Field(None, ge=1)
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0 = once per epoch")
    keep_checkpoints: int = Field(2, ge=1)
    eval_every_epochs: int = Field(1, ge=1)
    patience: int | None = Field(None, ge=1, description="stop after this many evals without improvement")
    select_metric: str = Field("ndcg@10", description="validation metric that picks the best checkpoint: a "
                               "retrieval metric (hr@K, ndcg@K with K in eval.ks, mrr) or a ranking-head one, "
                               "ranking.TASK.auc or ranking.TASK.gauc (e.g. ranking.click.gauc)")


class EvalConfig(_Strict):
    ks: list[int] = Field(default_factory=lambda: [10, 50, 200])
    batch_size: int = Field(512, ge=1)
    max_users: int | None = Field(None, ge=1, description="evaluate a deterministic subset (benchmarks)")


class EmbeddingConfig(_Strict):
    """The item-embedding table. Training always holds it in a row-sharded table updated by its own
    optimizer; a single-process run is one shard of the whole table."""

    optimizer: Literal["adamw", "adam", "adagrad", "sgd"] = Field(
        "adamw", description="adamw: every row each step with optim.weight_decay (exactly torch AdamW on the "
        "table); adam: lazy Adam on the rows a step touched; adagrad: row-wise Adagrad; sgd")
    lr: float | None = Field(None, gt=0.0, description="item-embedding learning rate; default optim.lr "
                             "(it follows optim.warmup_steps like the dense learning rate)")


class DistributedConfig(_Strict):
    """Multi-rank training (``grstack train --nproc N`` or a torchrun-style environment)."""

    sparse_group_size: int = Field(
        0, ge=0, description="ranks per sparse group: item embeddings are row-sharded and looked up by All2All "
        "inside a group, replicated across groups; 0 = all ranks form one group")
    max_shard_rows: int | None = Field(
        None, ge=1, description="most embedding rows one rank may hold; a plan needing more is rejected")
    timeout_s: float = Field(120.0, gt=0.0, description="a peer silent this long is dead: every rank exits")
    bucket_cap_mb: float = Field(
        25.0, gt=0.0, description="dense-gradient bucket size (MiB): each bucket is all-reduced as soon as "
        "backward has filled it (DDP's bucket_cap_mb); smaller buckets start sooner, larger ones cost fewer "
        "collectives")


class PipelineConfig(_Strict):
    """Nested pipelining of the sharded embedding (docs/architecture.md §4.4-4.6); none of it changes the
    numbers except ``semi_async`` (one step stale)."""

    dbp: bool = Field(False, description="dual-buffer pipelining: look up batch t+1 while t computes")
    microbatches: int = Field(1, ge=1, description="frozen-window pipelining: micro-batches per batch")
    cluster: bool = Field(False, description="key-centric clustering of sequences into micro-batches")
    semi_async: bool = Field(False, description="one-step-stale sparse forward (alternative to dbp)")

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if self.dbp and self.semi_async:
            raise ValueError("pipeline.dbp and pipeline.semi_async are alternatives; enable one")
        return self


class BalanceConfig(_Strict):
    """Token-aware batches: a global batch is reallocated across ranks by the cost a·L + b·L².

    The weights a run splits by: a resumed run's are its checkpoint's; otherwise ``profile``'s when set; else,
    with ``calibrate`` on more than one rank under ``mode=tokens``, fitted at start-up
    (``grstack.runtime.train.calibrate``); else ``cost_a`` / ``cost_b``."""

    mode: Literal["tokens", "count"] = Field(
        "tokens", description="tokens: balance cost across ranks; count: equal numbers of sequences")
    token_budget: int | None = Field(
        None, ge=1, description="tokens per rank per step (variable batch size); default train.batch_size "
        "sequences per step")
    cost_a: float = Field(1.0, ge=0.0, description="per-token cost (linear layers)")
    cost_b: float = Field(0.01, ge=0.0, description="per-token-pair cost (attention)")
    calibrate: bool = Field(
        False, description="fit cost_a, cost_b at start-up from the model's measured forward+backward time at "
        "lengths spanning the data's (only with more than one rank and mode=tokens: one rank has nothing to "
        "split); the fit goes to the summary and the run directory's balance_profile.json. Off by default: "
        "timings are noisy, so two calibrated runs of one config may split (and train) differently")
    profile: str | None = Field(
        None, description="a JSON file with fitted a and b (a run's balance_profile.json) to split by instead "
        "of cost_a, cost_b and calibrating; a relative path is read from the working directory")


class NegativesConfig(_Strict):
    """How training prepares sampled negatives (their number is loss.negatives)."""

    background: bool = Field(True, description="prepare batches and negatives in a background thread")
    prefetch: int = Field(2, ge=1, description="batches prepared ahead")
    fp16: bool = Field(False, description="send negative-only embedding rows in FP16 (positives stay FP32)")
    share_k: int = Field(1, ge=1, description="intra-batch logit sharing: each token also scores the "
                         "negatives of k-1 other tokens' sets (loss.sharing=token or group; drawn once per "
                         "rank batch, so micro-batches score what one batch scores)")


class Config(_Strict):
    name: str = "run"
    protocol: str = Field("", description="what the config measures and how, for humans")
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    embedding: EmbeddingConfig = Field(default_factory=EmbeddingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    negatives: NegativesConfig = Field(default_factory=NegativesConfig)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """Keys of earlier releases get a message saying where they went, not just "unknown key"."""
        if isinstance(data, dict):
            for section, key, new in MOVED_KEYS:
                if isinstance(data.get(section), dict) and key in data[section]:
                    raise ValueError(f"{section}.{key} is now {new}")
        return data

    @model_validator(mode="after")
    def _check(self) -> Config:
        sel = self.train.select_metric
        if sel.startswith(RANKING_PREFIX):
            if not re.fullmatch(r"ranking\.[A-Za-z0-9_]+\.(auc|gauc)", sel):
                raise ValueError(f"train.select_metric {sel!r}: a ranking metric is ranking.TASK.auc or "
                                 f"ranking.TASK.gauc (TASK: next, click, like, ... as the dataset's actions)")
            if not self.model.ranking_head or self.loss.ranking_weight <= 0 or self.model.type == "sasrec":
                raise ValueError(f"train.select_metric {sel!r} needs a trained ranking head (an HSTU or FuXi-α "
                                 f"model, model.ranking_head=true, loss.ranking_weight > 0)")
        elif sel not in metric_names(self.eval.ks):
            raise ValueError(f"train.select_metric {sel!r} is not one of {', '.join(metric_names(self.eval.ks))} "
                             f"or ranking.TASK.auc / ranking.TASK.gauc")
        if self.data.read == "shard" and self.data.format != "parquet":
            raise ValueError(f"data.read=shard reads a Parquet dataset's row groups, not data.format="
                             f"{self.data.format}; write it first (grstack data import/synth --out DIR) and "
                             f"set data.format=parquet, data.source=DIR")
        if self.data.user_features and self.data.read == "shard":
            raise ValueError("data.user_features needs data.read=all (the streamed pieces carry no user features)")
        if self.data.user_features and self.model.time_bias_query == "next":
            raise ValueError("model.time_bias_query=next does not combine with data.user_features (contextual "
                             "tokens have no next event)")
        if self.loss.full_softmax and self.loss.sharing != "batch":
            raise ValueError(f"loss.full_softmax=true scores the whole catalogue once per batch: it needs "
                             f"loss.sharing=batch, not {self.loss.sharing!r}")
        if self.loss.ranking_on == "exposures" and (not self.model.ranking_head or self.loss.ranking_weight <= 0
                                                    or self.model.type == "sasrec"):
            raise ValueError("loss.ranking_on=exposures trains the ranking head: it needs an HSTU or FuXi-α model "
                             "with model.ranking_head=true and loss.ranking_weight > 0")
        return self

    def ranking_block(self) -> int:
        """Logged exposures per ranking block (``LeaveOneOut.block``): 0 unless ``loss.ranking_on=exposures``."""
        return self.loss.ranking_candidates if self.loss.ranking_on == "exposures" else 0


MOVED_KEYS = (
    ("distributed", "sparse_optimizer", "embedding.optimizer (one trainer for every world size)"),
    ("distributed", "sparse_lr", "embedding.lr"),
    ("negatives", "offload", "removed (it was never read): semi-async always parks looked-up rows in host memory"),
)


RANKING_PREFIX = "ranking."


def metric_names(ks: list[int]) -> list[str]:
    return [f"{m}@{k}" for k in ks for m in ("hr", "ndcg")] + ["mrr"]


def _format_validation(exc: ValidationError, origin: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) if str(p).isprintable() else repr(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{loc}: {msg}")
    return f"{origin}: invalid config: " + "; ".join(parts)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise UserError(f"--set {dotted}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


_DOTTED_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        if "=" not in item or not item.split("=", 1)[0]:
            raise UserError(f"--set {item!r}: expected key=value, e.g. train.epochs=3")
        key, raw = item.split("=", 1)
        if not _DOTTED_KEY.fullmatch(key.strip()):
            raise UserError(f"--set {item!r}: {key.strip()!r} is not a config key (section.field, e.g. train.epochs)")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Reads, overrides and validates a config; every problem is a UserError naming file and field."""
    tree: dict[str, Any] = {}
    origin = "config"
    base_dir = Path.cwd()
    if path is not None:
        p = Path(path)
        origin = str(p)
        tree = _read_tree(p)
        base_dir = p.resolve().parent
    parsed = [(key, _as_typed(key, value, raw)) for (key, value), raw in
              zip(parse_overrides(overrides or []), overrides or [], strict=True)]
    for key, value in parsed:
        _set_path(tree, key, value)
    if any(key == "data.source" or key == "data" for key, _ in parsed):
        base_dir = Path.cwd()  # a path typed on the command line is the user's, relative to where they are
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as exc:
        raise UserError(_format_validation(exc, origin)) from None
    if cfg.data.format != "synth" and not cfg.data.source.startswith("fetched:"):  # fetched:NAME: data.fetch
        cfg.data.source = _resolve(cfg.data.source, base_dir)
    for key in ("item_features_file", "user_features_file"):
        value = getattr(cfg.data, key)
        if value != "auto":
            on_cli = any(k in (f"data.{key}", "data") for k, _ in parsed)
            setattr(cfg.data, key, _resolve(value, Path.cwd() if on_cli or path is None else Path(path).resolve().parent))
    return cfg


def _read_tree(p: Path) -> dict[str, Any]:
    """The YAML mapping of a config file; a missing, unreadable, binary, invalid or empty file is a UserError."""
    from grstack.runtime.cli_args import input_problem

    problem = input_problem(p, "file")
    if problem:
        raise UserError(f"config file {problem}")
    try:
        loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{p}: not a text file (a config is YAML text)") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{p}: not valid YAML{where}") from None
    if loaded is None or loaded == {}:
        raise UserError(f"{p}: the config is empty (expected sections such as data:, model:, train:; "
                        f"see configs/)")
    if not isinstance(loaded, dict):
        raise UserError(f"{p}: a config must be a mapping of sections")
    return loaded


def _as_typed(key: str, value: Any, item: str) -> Any:
    """A ``--set`` value for a text field stays the text typed (``data.source=2024`` is a path, not 2024)."""
    model: Any = Config
    annotation: Any = None
    for part in key.split("."):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return value
        annotation = field.annotation
        model = annotation
    kinds = _kinds(annotation)
    if str in kinds and isinstance(value, (int, float, bool)):
        return item.split("=", 1)[1].strip()
    return value


def _resolve(path: str, base_dir: Path) -> str:
    if not path or "\0" in path:
        raise UserError(f"{path!r} is not a usable path (data.source, data.*_features_file)")
    p = Path(os.path.expanduser(path))
    return str(p if p.is_absolute() else (base_dir / p).resolve())


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def check_catalogue(cfg: Config, num_items: int, dataset: str) -> None:
    """Refuses sampled negatives that outnumber the catalogue (known once the data is): every item would be
    drawn several times a step, so ``loss.full_softmax`` says what was meant, exactly and cheaper."""
    if not cfg.loss.full_softmax and cfg.loss.negatives > num_items:
        raise UserError(f"loss.negatives={cfg.loss.negatives} is more than the {num_items} items of {dataset}: "
                        f"set loss.negatives to at most {num_items}, or loss.full_softmax=true to score them all")
