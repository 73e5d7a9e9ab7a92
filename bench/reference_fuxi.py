"""Train FuXi-α's reference code (USTC-StarTeam/FuXi-alpha, a fork of Meta's generative-recommenders) on
MovieLens-100K on one CPU rank, to see whether FuXi-α beats HSTU there in its authors' own implementation.

Nothing of that code is copied here and its files are not edited: this script patches names at run time, only
so that it runs without a GPU, and leaves the models, loss, negative sampler, optimiser and evaluation alone.

* gloo instead of nccl, the model on the CPU, DDP without ``device_ids``; anomaly detection off (a debug aid
  that only slows the step);
* ``torch.ops.fbgemm.{asynchronous_complete_cumsum, jagged_to_padded_dense, dense_to_jagged}`` (fbgemm_gpu has
  no build for this torch) as the same functions in plain torch;
* an ``ml-100k`` dataset built as its ``ml-1m`` one (events sorted by time per user, ties in file order, rows
  shuffled; train on s[:-1], evaluate on s[-1] against every item with the user's history filtered out),
  without the item features its models never read;
* top-k computed to (items − padded history length) and padded with id 0 to the code's k = min(2500, items):
  with 1,682 items that k leaves fewer valid ids than k once the history is filtered, and its reshape fails;
  a target outside the cut counts as unranked, as one beyond 2,500 does in the code; NDCG@10 and HR@10 are
  unaffected;
* ``torch.manual_seed(seed)`` before the model is built (the code seeds only ``random``), one thread, no
  TensorBoard writer.

Set-up (once)::

    # the code: github.com/USTC-StarTeam/FuXi-alpha (commit 48bfc77 measured), checked out at $FUXI
    .venv/bin/pip install --target /tmp/fxdeps --no-deps pandas python-dateutil pytz tzdata gin-config \\
        absl-py six einops

Run (from an empty working directory: the code writes ``exps/``, ``ckpts/`` and reads ``tmp/``; ``ML100K`` is a
folder with RecBole's ``ml-100k.inter``)::

    .venv/bin/python -P bench/reference_fuxi.py --code $FUXI --deps /tmp/fxdeps \\
        --config configs/ml-1m/fuxi-sampled-softmax-n128-final.gin --seed 0 \\
        --data ML100K/ml-100k.inter

It prints the code's own log; ``eval @ epoch E ...: NDCG@10 ...`` lines are its full evaluation after each
epoch. Results and protocol: docs/fuxi.md, "FuXi-α's reference code on MovieLens-100K".

``--parity`` instead checks that grstack's block is the reference's function: it builds the reference FuXi and
``grstack.runtime.model.FuXiAlpha`` (2 blocks, d=50, ``time_bias_query=next``, the reference's convention),
copies the reference's weights into grstack's (the position bias reversed: grstack indexes it by ``i - j``,
the code by ``j - i + N - 1``), feeds both the same jagged input embeddings and timestamps, and prints the
largest difference of the L2-normalised outputs over every token. Both take the semantic channel's ``1/N``
from the same N here (the code's padded length; training differs by it, docs/fuxi.md)::

    .venv/bin/python -P bench/reference_fuxi.py --code $FUXI --deps /tmp/fxdeps --parity
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import types
from pathlib import Path


def _jagged_mask(offsets, n: int):
    import torch

    lengths = (offsets[1:] - offsets[:-1]).clamp(max=n)
    idx = torch.arange(n, device=offsets.device)
    mask = idx[None, :] < lengths[:, None]
    return mask, (offsets[:-1, None] + idx[None, :])[mask]


def asynchronous_complete_cumsum(lengths):
    import torch

    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def jagged_to_padded_dense(values, offsets, max_lengths, padding_value=0.0):
    mask, src = _jagged_mask(offsets[0], int(max_lengths[0]))
    out = values.new_full((offsets[0].numel() - 1, int(max_lengths[0]), *values.shape[1:]), padding_value)
    out[mask] = values[src]
    return out


def dense_to_jagged(dense, offsets, total_L=None):
    mask, _ = _jagged_mask(offsets[0], dense.shape[1])
    return dense[mask], offsets


def write_sequences(inter: Path, out_csv: Path) -> int:
    """The code's ``sasrec_format.csv`` from a RecBole ``.inter`` file, made as the code makes its ml-1m one
    (rows shuffled, here with a fixed seed); returns the number of items (MovieLens's own ids 1..n, which the
    code uses unchanged)."""
    import pandas as pd

    r = pd.read_csv(inter, sep="\t")
    r.columns = ["user_id", "movie_id", "rating", "unix_timestamp"]
    r = r.sort_values(by=["unix_timestamp"], kind="mergesort")  # stable: ties in file order
    g = r.groupby("user_id", sort=True)

    def joined(col: str) -> list[str]:
        return [",".join(str(int(v)) for v in x) for x in g[col].apply(list)]

    df = pd.DataFrame({"user_id": list(g.groups.keys()), "sequence_item_ids": joined("movie_id"),
                       "sequence_ratings": joined("rating"), "sequence_timestamps": joined("unix_timestamp")})
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    df.sample(frac=1, random_state=0).reset_index().to_csv(out_csv, index=False)
    return int(r.movie_id.nunique())


def parity(seed: int = 0) -> float:
    """Largest |grstack − reference| over the outputs of three sequences (lengths 37, 120, 5), same weights."""
    import torch
    import torch.nn.functional as F
    from generative_recommenders.modeling.sequential.embedding_modules import LocalEmbeddingModule
    from generative_recommenders.modeling.sequential.encoder_utils import fuxi_encoder
    from generative_recommenders.modeling.sequential.input_features_preprocessors import (
        LearnablePositionalEmbeddingInputFeaturesPreprocessor,
    )
    from generative_recommenders.modeling.sequential.output_postprocessors import L2NormEmbeddingPostprocessor
    from generative_recommenders.modeling.similarity_utils import get_similarity_function

    from grstack.runtime.data.jagged import JaggedBatch
    from grstack.runtime.model.fuxi import FuXiAlpha

    torch.manual_seed(seed)
    d, num_items, max_len = 50, 100, 200
    n = max_len + 1  # grstack's positions (history + the candidate slot); the code's max_seq + max_output
    interaction, _ = get_similarity_function(module_type="DotProduct", query_embedding_dim=d, item_embedding_dim=d)
    ref = fuxi_encoder(
        max_sequence_length=n - 11, max_output_length=11,
        embedding_module=LocalEmbeddingModule(num_items=num_items, item_embedding_dim=d),
        interaction_module=interaction,
        input_preproc_module=LearnablePositionalEmbeddingInputFeaturesPreprocessor(n, d, 0.0),
        output_postproc_module=L2NormEmbeddingPostprocessor(d, 1e-6), activation_checkpoint=False, verbose=False,
        num_blocks=2, num_heads=1, dqk=d, dv=d, linear_dropout_rate=0.0).eval()
    ours = FuXiAlpha(num_items, max_len=max_len, d_model=d, num_blocks=2, num_heads=1, dqk=d, dv=d, dropout=0.0,
                     input_dropout=0.0, time_bias=True, ranking_head=False, time_bias_query="next").eval()
    with torch.no_grad():
        ours.pos_emb.weight.copy_(ref._input_features_preproc._pos_emb.weight[:n])
        for mine, theirs in zip(ours.layers, ref._fuxi._attention_layers, strict=True):
            mine.uvqk.weight.copy_(theirs._uvqk.T)
            mine.pos_weight.copy_(theirs._rel_attn_bias._pos_w[:n].flip(0))
            mine.time_weight.copy_(theirs._rel_attn_bias._ts_w)
            for name in ("lin0", "lin1", "lin2", "lin3"):
                getattr(mine, name).weight.copy_(getattr(theirs._mffn, name).weight)
            mine.lin0.bias.copy_(theirs._mffn.lin0.bias)

    lengths = [37, 120, 5]
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    ts = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, :length] = torch.randint(1, num_items + 1, (length,))
        ts[b, :length] = torch.cumsum(torch.randint(0, 5000, (length,)), 0) + 10**9
        ts[b, length] = ts[b, length - 1]  # the last token's "next" time: its own, as grstack's without candidates
    emb = torch.randn(len(lengths), n, d) * 0.1 * (ids != 0).unsqueeze(-1)
    offsets = torch.tensor([0, *lengths]).cumsum(0)

    def jagged(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[b, :length] for b, length in enumerate(lengths)])

    with torch.no_grad():
        theirs_out = jagged(ref(past_lengths=torch.tensor(lengths), past_ids=ids, past_embeddings=emb,
                                past_payloads={"timestamps": ts}))
        batch = JaggedBatch(item_ids=jagged(ids), offsets=offsets, timestamps=jagged(ts))
        mine_out = F.normalize(ours.encode(batch, item_rows=jagged(emb)), dim=-1, eps=1e-6)
    return float((mine_out - theirs_out).abs().max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", required=True, type=Path, help="a FuXi-alpha checkout")
    p.add_argument("--deps", type=Path, help="a --target folder holding pandas, gin-config, absl-py, einops")
    p.add_argument("--config", help="a gin file of the code, relative to --code")
    p.add_argument("--data", type=Path, help="MovieLens-100K as a RecBole .inter file")
    p.add_argument("--parity", action="store_true", help="compare grstack's FuXi-α block with the code's on "
                   "the same weights instead of training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, help="override the config's num_epochs (smoke tests only)")
    p.add_argument("--port", type=int, default=12355)
    a = p.parse_args()
    if not (a.code / "generative_recommenders").is_dir():
        p.error(f"{a.code} is not a FuXi-alpha checkout (no generative_recommenders/)")
    if not a.parity:
        if not a.config or not (a.code / a.config).is_file():
            p.error(f"no config {a.config} under {a.code} (--config)")
        if not a.data or not a.data.is_file():
            p.error(f"no data file {a.data} (--data)")
    if a.deps:
        sys.path.insert(0, str(a.deps))
    sys.path.insert(0, str(a.code.resolve()))

    import torch

    for fn in (asynchronous_complete_cumsum, jagged_to_padded_dense, dense_to_jagged):
        setattr(torch.ops.fbgemm, fn.__name__, fn)
    tensorboard = types.ModuleType("torch.utils.tensorboard")
    tensorboard.SummaryWriter = lambda *_, **__: None  # type: ignore[attr-defined]
    sys.modules["torch.utils.tensorboard"] = tensorboard
    torch.autograd.set_detect_anomaly = lambda *_, **__: None  # type: ignore[assignment]

    if a.parity:
        err = parity(a.seed)
        print(f"grstack FuXiAlpha vs the reference FuXi, same weights and input: max |difference| = {err:.3g}")
        sys.exit(0 if err < 1e-5 else 1)

    import gin
    from generative_recommenders.data import reco_dataset
    from generative_recommenders.data.dataset import DatasetV2
    from generative_recommenders.indexing.candidate_index import CandidateIndex
    from generative_recommenders.trainer import train
    from torch.nn.parallel import DistributedDataParallel

    num_items = write_sequences(a.data, Path("tmp/ml-100k/sasrec_format.csv"))

    def get_reco_dataset(dataset_name, max_sequence_length, chronological, positional_sampling_ratio=1.0):
        def split(ignore_last_n: int, ratio: float) -> DatasetV2:
            return DatasetV2(ratings_file="tmp/ml-100k/sasrec_format.csv", padding_length=max_sequence_length + 1,
                             ignore_last_n=ignore_last_n, chronological=chronological, sample_ratio=ratio)

        return reco_dataset.RecoDataset(
            max_sequence_length=max_sequence_length, num_unique_items=num_items, max_item_id=num_items,
            all_item_ids=list(range(1, num_items + 1)),
            train_dataset=split(1, positional_sampling_ratio), eval_dataset=split(0, 1.0))

    top_k = CandidateIndex.get_top_k_outputs

    def capped_top_k(self, query_embeddings, k, top_k_module, invalid_ids, **kw):
        if invalid_ids is None or k + invalid_ids.size(1) <= self.num_objects:
            return top_k(self, query_embeddings, k, top_k_module, invalid_ids, **kw)
        ids, scores, emb = top_k(self, query_embeddings, self.num_objects - invalid_ids.size(1), top_k_module,
                                 invalid_ids, **kw)
        pad = k - ids.size(1)  # id 0 is padding: never a target, so a target not in the cut ranks past it
        return (torch.nn.functional.pad(ids, (0, pad)),
                torch.nn.functional.pad(scores, (0, pad), value=float("-inf")), emb)

    def setup(rank: int, world_size: int, master_port: int) -> None:
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(master_port))
        torch.distributed.init_process_group("gloo", rank=0, world_size=world_size)

    train.get_reco_dataset = get_reco_dataset
    train.setup = setup
    train.DDP = lambda model, **kw: DistributedDataParallel(model, broadcast_buffers=False)
    loader = train.create_data_loader
    train.create_data_loader = lambda dataset, rank, **kw: loader(dataset, rank=0, **kw)
    CandidateIndex.get_top_k_outputs = capped_top_k

    logging.basicConfig(stream=sys.stdout, level=logging.INFO)
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    gin.parse_config_file(str(a.code / a.config))
    gin.bind_parameter("train_fn.dataset_name", "ml-100k")
    gin.bind_parameter("train_fn.random_seed", a.seed)
    if a.epochs:
        gin.bind_parameter("train_fn.num_epochs", a.epochs)
    # rank is the CPU device: the code does `device = rank`; rank != 0 also keeps its writer and checkpoints off
    train.train_fn(torch.device("cpu"), 1, a.port)


if __name__ == "__main__":
    main()
