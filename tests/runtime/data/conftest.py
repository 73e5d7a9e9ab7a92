"""Small source files in every supported format, written into tmp_path by the tests that need them (whole
datasets in the real formats ship in ``fixtures/``: format_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

RECBOLE_HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
KUAIRAND_HEADER = ("user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,"
                   "is_hate,long_view,play_time_ms,duration_ms,profile_stay_time,comment_stay_time,"
                   "is_profile_enter,is_rand,tab\n")


def kuairand_row(user: int, video: int, time_ms: int, click: int = 0, like: int = 0, long_view: int = 0,
                 follow: int = 0) -> str:
    return (f"{user},{video},20220408,1000,{time_ms},{click},{like},{follow},0,0,0,{long_view},"
            f"5000,10000,0,0,0,0,1\n")


@pytest.fixture
def write(tmp_path: Path):
    """write(name, text) -> path of a file under tmp_path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return _write


@pytest.fixture
def recbole_file(write) -> Path:
    # user 2 has a timestamp tie (items 7 and 55 at t=200): file order must be kept.
    rows = [(2, 100, 300), (1, 7, 50), (2, 7, 200), (2, 55, 200), (1, 100, 10), (1, 55, 60), (2, 3, 100)]
    return write("src/toy.inter", RECBOLE_HEADER + "".join(f"{u}\t{i}\t4\t{t}\n" for u, i, t in rows))


@pytest.fixture
def kuairand_dir(write) -> Path:
    base = 1_649_376_000_000
    write("kr/log_standard_4_08_to_4_21_1k.csv", KUAIRAND_HEADER
          + kuairand_row(5, 900, base + 2500, click=1, long_view=1)
          + kuairand_row(5, 901, base + 1200, click=1, like=1)
          + kuairand_row(7, 900, base + 10, click=0)
          + kuairand_row(5, 902, base + 1100, click=0, follow=1))
    write("kr/log_standard_4_22_to_5_08_1k.csv", KUAIRAND_HEADER
          + kuairand_row(7, 33, base + 20, click=1)
          + kuairand_row(7, 901, base + 30_000, click=1, like=1, long_view=1))
    write("kr/log_random_4_22_to_5_08_1k.csv", KUAIRAND_HEADER + kuairand_row(5, 1, base, click=1))
    return write("kr/README", "not a log").parent
