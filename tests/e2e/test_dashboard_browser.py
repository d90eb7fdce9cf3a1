"""The dashboard page in a real headless Chromium: every panel in the DOM, and a screenshot that
shows them (its size, many colours, the wait phase's red, the straggler and hang banners).

Chromium is Debian's ``chromium`` package; ``.ci/run`` installs it where it runs as root.
Elsewhere these tests skip, saying so. Chromium's profile, cache and crash files stay in the
test's temporary folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from unit import dashboard_samples as ds  # tests/unit: the synthetic run directories

WIDTH, HEIGHT = 1200, 2600
WAIT_RED = (0xD6, 0x27, 0x28)  # matplotlib's tab:red, the "wait" phase
DATA_CYAN = (0x17, 0xBE, 0xCF)  # tab:cyan, the "data" phase
HANG_BG = (0xFD, 0xE8, 0xE8)
STRAGGLER_BG = (0xFF, 0xF3, 0xCD)
PANELS = ("Step anatomy per rank", "Step anatomy over time", "Memory per rank", "Throughput",
          "Straggler", "Hang", "Events")


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no headless browser: Debian's chromium package is not installed "
                    "(.ci/run installs it as root: apt-get install chromium)")
    return found


def _browse(tmp_path: Path, url: str, *what: str) -> subprocess.CompletedProcess[str]:
    home = tmp_path / "browser-home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "config"),
           "XDG_CACHE_HOME": str(home / "cache")}
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--disable-crash-reporter", "--no-first-run", f"--user-data-dir={home / 'profile'}",
           f"--window-size={WIDTH},{HEIGHT}", *what, url]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture
def page_url(tmp_path):
    from rankwise.dashboard.web import serve

    run = ds.write_run(tmp_path / "run", hang="rank 2 waits in all_reduce #41 for rank 3 "
                       "(node 1), which stopped in backward")
    server = serve(str(run), "127.0.0.1", 0, refresh_s=0)
    yield server.url
    server.close()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """The run directory of a real 2-rank DDP job whose rank 1 loads its data slowly."""
    _chromium()  # no browser: skip before spending a job
    folder = tmp_path_factory.mktemp("real")
    script = Path(__file__).parent / "scripts" / "slow_data_train.py"
    done = subprocess.run(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "--profile-steps",
         "1", "--log-dir", "logs", str(script)],
        cwd=folder, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (folder / "logs" / "runs").iterdir()
    return run


def test_a_real_run_s_page_in_the_browser(tmp_path, real_run) -> None:
    from PIL import Image

    from rankwise.dashboard.web import serve

    server = serve(str(real_run), "127.0.0.1", 0, refresh_s=0)
    try:
        dom = _browse(tmp_path, server.url, "--dump-dom").stdout
        shot = tmp_path / "real.png"
        _browse(tmp_path, server.url, f"--screenshot={shot}")
    finally:
        server.close()
    for title in PANELS[:4]:
        assert f"<h2>{title}</h2>" in dom, title
    assert dom.count("<svg") == 4 and "ddp \u00b7 2 ranks" in dom
    assert "rank 0" in dom and "rank 1" in dom  # the plots' text stays text
    assert "<h2>End of run</h2>" in dom  # rank 0 left its table: the job is over
    with Image.open(shot) as img:
        assert img.size == (WIDTH, HEIGHT)
        counts = {c: n for n, c in img.convert("RGB").getcolors(maxcolors=WIDTH * HEIGHT)}
    assert len(counts) > 200
    assert counts.get(WAIT_RED, 0) > 2000  # rank 0 waits for rank 1
    assert counts.get(DATA_CYAN, 0) > 2000  # rank 1's data wait


def test_every_panel_is_in_the_rendered_page(tmp_path, page_url) -> None:
    dom = _browse(tmp_path, page_url, "--dump-dom").stdout
    for title in PANELS:
        assert f"<h2>{title}</h2>" in dom, title
    assert dom.count("<svg") == 4
    assert "straggler: rank 2 (node 1), compute" in dom
    assert "rank 2 waits in all_reduce #41" in dom


def test_the_screenshot_shows_the_panels(tmp_path, page_url) -> None:
    from PIL import Image

    shot = tmp_path / "page.png"
    _browse(tmp_path, page_url, f"--screenshot={shot}")
    with Image.open(shot) as img:
        assert img.size == (WIDTH, HEIGHT)
        rgb = img.convert("RGB")
        counts = {c: n for n, c in rgb.getcolors(maxcolors=WIDTH * HEIGHT)}
    assert len(counts) > 200  # drawn, not blank or an error page
    assert counts.get(WAIT_RED, 0) > 5000  # three ranks waiting 30 of 71 ms, in two plots
    assert counts.get(HANG_BG, 0) > 10000 and counts.get(STRAGGLER_BG, 0) > 10000
