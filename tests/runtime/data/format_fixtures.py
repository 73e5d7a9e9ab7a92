"""Small synthetic datasets in two real on-disk formats, shipped in ``fixtures/`` so the importer tests run in
a clean clone: a RecBole atomic-file set shaped like MovieLens-100K (``.inter``, ``.item``, ``.user``) and
an S3-Rec set shaped like Amazon Beauty (``.txt`` sequences, ``_item2attributes.json``).

Every value is drawn here from a seeded generator (no row of a real dataset), with the quirks the real files
have: ratings in no time order, timestamp ties within a user, a movie whose year and genre are
``unkonwn``/``unknown``, alphanumeric zip codes, S3-Rec's items numbered by first appearance and attribute
ids numbered in the JSON's key order. ``python -P tests/runtime/data/format_fixtures.py`` rewrites the files;
``test_format_fixtures.py`` checks that the shipped ones are this generator's output.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ML_DIR = FIXTURES / "ml-100k-like"
BEAUTY_DIR = FIXTURES / "beauty-like"

ML_USERS, ML_ITEMS = 40, 150
BEAUTY_USERS, BEAUTY_POOL = 200, 300
GENRES = ("Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
          "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")
OCCUPATIONS = ("administrator", "artist", "doctor", "educator", "engineer", "entertainment", "executive",
               "healthcare", "homemaker", "lawyer", "librarian", "marketing", "none", "other", "programmer",
               "retired", "salesman", "scientist", "student", "technician", "writer")
WORDS = ("Blue", "Night", "River", "Last", "Summer", "Stone", "Garden", "Return", "City", "Silent", "Iron",
         "Dream", "North", "Glass", "Winter", "Road", "King", "Shadow", "Little", "House")
UNKNOWN_ITEM = 77  # the real file's item 267: "unkonwn" title and year, genre "unknown"


def _popular(rng: random.Random, pool: int, k: int) -> list[int]:
    """k distinct ids from 1..pool, lower ids more often (a heavy head, as real catalogues have)."""
    weights = [1.0 / (i ** 0.8) for i in range(1, pool + 1)]
    chosen: list[int] = []
    while len(chosen) < k:
        item = rng.choices(range(1, pool + 1), weights)[0]
        if item not in chosen:
            chosen.append(item)
    return chosen


def _zip(rng: random.Random) -> str:
    if rng.random() < 0.05:
        return "".join(rng.choice("ABCEGHJKLMNPRSTVXY0123456789") for _ in range(5))
    return f"{rng.randrange(100000):05d}"


def movielens_like(rng: random.Random) -> dict[str, str]:
    """RecBole's ml-100k files: user_id, item_id, rating, timestamp rows in no order, then items and users."""
    per_user = {u: _popular(rng, ML_ITEMS, rng.randint(6, 20)) for u in range(1, ML_USERS + 1)}
    seen = {i for items in per_user.values() for i in items}
    for item in range(1, ML_ITEMS + 1):  # every item rated at least once, so the raw ids are 1..ML_ITEMS
        if item not in seen:
            per_user[rng.randint(1, ML_USERS)].append(item)
    rows = []
    for user, items in per_user.items():
        t = 874_724_710 + rng.randrange(10_000_000)
        for item in items:
            t += rng.choice((0, 0, 0, 1, 7, 60, 3_600, 86_400))  # many same-second ratings, as in ML-100K
            rating = rng.choices((1, 2, 3, 4, 5), (6, 11, 27, 34, 22))[0]
            rows.append(f"{user}\t{item}\t{rating}\t{t}\n")
    rng.shuffle(rows)
    inter = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + "".join(rows)
    item_lines = []
    for item in range(1, ML_ITEMS + 1):
        if item == UNKNOWN_ITEM:
            item_lines.append(f"{item}\tunkonwn\tunkonwn\tunknown\n")
            continue
        title = " ".join(rng.sample(WORDS, rng.randint(1, 3))) + (", The" if rng.random() < 0.15 else "")
        genres = " ".join(sorted(rng.sample(GENRES, rng.randint(1, 3)), key=GENRES.index))
        item_lines.append(f"{item}\t{title}\t{rng.randint(1930, 1998)}\t{genres}\n")
    user_lines = [f"{u}\t{rng.randint(7, 73)}\t{rng.choice('MF')}\t{rng.choice(OCCUPATIONS)}\t{_zip(rng)}\n"
                  for u in range(1, ML_USERS + 1)]
    return {
        "ml-100k-like.inter": inter,
        "ml-100k-like.item": "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
                             + "".join(item_lines),
        "ml-100k-like.user": "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
                             + "".join(user_lines),
    }


def beauty_like(rng: random.Random) -> dict[str, str]:
    """S3-Rec's Beauty.txt ("user item item ..." in time order, users 1..N, items numbered by first appearance)
    and its _item2attributes.json (item id -> attribute ids, numbered by first appearance in key order)."""
    dense: dict[int, int] = {}
    lines = []
    for user in range(1, BEAUTY_USERS + 1):
        items = [dense.setdefault(i, len(dense) + 1) for i in _popular(rng, BEAUTY_POOL, rng.randint(5, 12))]
        lines.append(" ".join(map(str, [user, *items])) + "\n")
    keys = list(range(1, len(dense) + 1))
    rng.shuffle(keys)
    attr_ids: dict[int, int] = {}
    attributes = {str(k): [attr_ids.setdefault(a, len(attr_ids) + 1) for a in rng.sample(range(60), rng.randint(1, 6))]
                  for k in keys}
    return {"BeautyLike.txt": "".join(lines), "BeautyLike_item2attributes.json": json.dumps(attributes) + "\n"}


def generate() -> dict[Path, str]:
    """Every fixture file's path and text (seed 0)."""
    rng = random.Random(0)
    files = {ML_DIR / name: text for name, text in movielens_like(rng).items()}
    files |= {BEAUTY_DIR / name: text for name, text in beauty_like(rng).items()}
    return files


def write(root: Path = FIXTURES) -> list[Path]:
    out = []
    for path, text in generate().items():
        target = root / path.relative_to(FIXTURES)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        out.append(target)
    return out


if __name__ == "__main__":
    for p in write(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURES):
        print(p)
