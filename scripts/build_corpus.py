#!/usr/bin/env python3
"""Build the multi-domain text corpus for the embedded mini MoE (issue 6), offline.

Four domains, all read from files that exist on these machines:

  python  Python 3.11 standard-library source (top-level modules, then packages)
  prose   English documentation: man pages (sections 1, 5, 7, 8) rendered to plain text
          with `man` (gcloud's generated pages excluded), and README / *.md / *.txt / *.rst / FAQ / licence files under
          /usr/share/doc (changelogs excluded)
  shell   shell scripts: files with an sh/bash/dash shebang or a .sh name under /usr/bin,
          /usr/sbin, /etc, /usr/share, /usr/lib, /usr/libexec, the pyenv tree, plus
          /usr/share/bash-completion/completions
  c       C headers under /usr/include

Each file is cut into chunks of at most --chunk-chars characters at line boundaries;
chunks that are short, mostly non-ASCII or exact duplicates (licence texts repeat a lot)
are dropped. Every *file* is assigned to one split by a hash of its domain and path, so no
file contributes to more than one split:

  ~8 %  held-out     -> data/corpus/heldout.jsonl     (shipped; --per-domain records/domain)
  ~8 %  calibration  -> data/corpus/calibration.jsonl (shipped; --per-domain records/domain)
  rest  training     -> .cache/corpus/train.jsonl     (not shipped; re-derived by this script)

Records are JSON lines {"text": ..., "source": <domain>, "path": <file it came from>}.
Everything is deterministic: sorted directory walks, hash-based split assignment and a
fixed-seed RNG for sampling. The shipped splits depend on the files of the machine that
built them; data/corpus/manifest.json records counts and sha256 of each split.

usage: python scripts/build_corpus.py [--out-dir data/corpus] [--train-out .cache/corpus/train.jsonl]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time

DOMAINS = ("python", "prose", "shell", "c")
PY_LIB = "/root/.pyenv/versions/3.11.7/lib/python3.11"
SHEBANG = re.compile(rb"^#!\s*(/usr)?/bin/(env\s+)?(ba|da|k)?sh\b")
MAN_DIRS = ["/usr/share/man/man1", "/usr/share/man/man5", "/usr/share/man/man7", "/usr/share/man/man8"]
DOC_ROOT = "/usr/share/doc"
DOC_NAME = re.compile(
    r"^(README|FAQ|COPYING|LICEN[CS]E|copyright|AUTHORS|THANKS|TODO|HACKING|"
    r"CONTRIBUTING|INSTALL|USAGE)([._-].*)?$|.*\.(md|txt|rst|text)(\.gz)?$",
    re.IGNORECASE,
)
DOC_SKIP = re.compile(r"(changelog|ChangeLog|CHANGELOG|NEWS|CMakeLists|/html/|/examples?/|\.py|\.c$)")
SHELL_ROOTS = ["/usr/bin", "/usr/sbin", "/etc", "/usr/share", "/usr/lib", "/usr/libexec", "/root/.pyenv"]


def walk_sorted(root):
    """Yield regular (non-symlink) file paths under root in sorted order."""
    for dp, dns, fns in os.walk(root):
        dns.sort()
        for f in sorted(fns):
            p = os.path.join(dp, f)
            if not os.path.islink(p) and os.path.isfile(p):
                yield p


def read_text(path, limit):
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                raw = fh.read(limit)
        else:
            with open(path, "rb") as fh:
                raw = fh.read(limit)
    except (OSError, EOFError):
        return None
    if b"\0" in raw:
        return None
    return raw.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- domain sources


def gather_python(a):
    paths = sorted(p for p in os.listdir(PY_LIB) if p.endswith(".py"))
    out = [os.path.join(PY_LIB, p) for p in paths]
    # packages (sorted), tests and bundled third-party code excluded
    for p in walk_sorted(PY_LIB):
        rel = os.path.relpath(p, PY_LIB)
        if (
            "/" in rel
            and p.endswith(".py")
            and not re.search(r"(^|/)(test|tests|idle_test|site-packages|lib2to3/tests|__phello__)(/|$)", rel)
        ):
            out.append(p)
    for p in out:
        t = read_text(p, a.max_file_bytes)
        if t:
            yield p, t


def render_man(path):
    env = dict(os.environ, MANWIDTH="80", GROFF_NO_SGR="1", LANG="C.UTF-8", LC_ALL="C.UTF-8")
    try:
        r = subprocess.run(["man", "--nh", "--nj", "-l", path], capture_output=True, env=env, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    t = r.stdout.decode("utf-8", errors="replace")
    t = re.sub(r".\x08", "", t)
    lines = []
    for ln in t.splitlines():
        ln = re.sub(r"\s{2,}", " ", ln.strip())
        lines.append(ln)
    # drop the running header/footer lines (e.g. "LS(1) User Commands LS(1)")
    if lines and re.match(r"^\S+\(\w+\)", lines[0]):
        lines = lines[1:]
    if lines and re.search(r"\S+\(\w+\)$", lines[-1]):
        lines = lines[:-1]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def gather_prose(a):
    man = []
    for d in MAN_DIRS:
        if os.path.isdir(d):
            # gcloud's ~16k generated pages would swamp the sample: leave them out
            man += [
                p
                for p in walk_sorted(d)
                if os.path.getsize(p) > 600 and not os.path.basename(p).startswith("gcloud")
            ]
    rng = random.Random(a.seed)
    if len(man) > a.man_pages:
        man = sorted(rng.sample(man, a.man_pages))
    for p in man:
        t = render_man(p)
        if t:
            yield p, t
    per_pkg = {}
    for p in walk_sorted(DOC_ROOT):
        rel = os.path.relpath(p, DOC_ROOT)
        name = os.path.basename(p)
        if not DOC_NAME.match(name) or DOC_SKIP.search("/" + rel):
            continue
        pkg = rel.split("/")[0]
        if per_pkg.get(pkg, 0) >= a.doc_pkg_bytes:
            continue
        t = read_text(p, a.max_file_bytes)
        if t:
            per_pkg[pkg] = per_pkg.get(pkg, 0) + len(t)
            yield p, t


def gather_shell(a):
    seen = set()
    for root in SHELL_ROOTS:
        for p in walk_sorted(root):
            if "/site-packages/" in p or p.startswith("/usr/share/doc/"):
                continue
            try:
                sz = os.path.getsize(p)
                if sz < 200 or sz > 200_000:
                    continue
                with open(p, "rb") as fh:
                    head = fh.read(64)
            except OSError:
                continue
            if SHEBANG.match(head) or (p.endswith(".sh") and b"\0" not in head):
                t = read_text(p, a.max_file_bytes)
                if t and p not in seen:
                    seen.add(p)
                    yield p, t
    for p in walk_sorted("/usr/share/bash-completion/completions"):
        if p not in seen:
            t = read_text(p, a.max_file_bytes)
            if t:
                yield p, t


def gather_c(a):
    for p in walk_sorted("/usr/include"):
        if p.endswith(".h"):
            t = read_text(p, a.max_file_bytes)
            if t:
                yield p, t


GATHER = {"python": gather_python, "prose": gather_prose, "shell": gather_shell, "c": gather_c}


# ---------------------------------------------------------------- chunking and splits


def chunks_of(text, max_chars, min_chars):
    """Cut text into chunks of <= max_chars at line boundaries (long lines are cut)."""
    out, cur, n = [], [], 0
    for ln in text.splitlines(keepends=True):
        while len(ln) > max_chars:
            if cur:
                out.append("".join(cur))
                cur, n = [], 0
            out.append(ln[:max_chars])
            ln = ln[max_chars:]
        if n + len(ln) > max_chars and cur:
            out.append("".join(cur))
            cur, n = [], 0
        cur.append(ln)
        n += len(ln)
    if cur:
        out.append("".join(cur))
    res = []
    for c in out:
        c = c.strip("\n")
        if len(c.strip()) < min_chars:
            continue
        ascii_frac = sum(ch < "\x80" for ch in c) / len(c)
        if ascii_frac < 0.97 or "\ufffd" in c:
            continue
        res.append(c)
    return res


def split_of(domain, path, heldout_frac, calib_frac):
    h = int.from_bytes(hashlib.sha256(f"{domain}:{path}".encode()).digest()[:8], "big") / 2**64
    if h < heldout_frac:
        return "heldout"
    if h < heldout_frac + calib_frac:
        return "calibration"
    return "train"


def sample_split(recs, n, per_file, rng):
    """Pick n records, at most per_file from one file, spread over files."""
    by_file = {}
    for r in recs:
        by_file.setdefault(r["path"], []).append(r)
    pool = []
    for p in sorted(by_file):
        rs = by_file[p]
        pool += rs if len(rs) <= per_file else rng.sample(rs, per_file)
    if len(pool) > n:
        return rng.sample(pool, n)
    # small domains: top up from the records the per-file cap left out
    chosen = {id(r) for r in pool}
    rest = [r for r in recs if id(r) not in chosen]
    pool += rng.sample(rest, min(n - len(pool), len(rest)))
    return pool


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="data/corpus")
    ap.add_argument("--train-out", default=".cache/corpus/train.jsonl")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--chunk-chars", type=int, default=1500)
    ap.add_argument("--min-chars", type=int, default=200)
    ap.add_argument("--per-domain", type=int, default=100, help="records per domain in each shipped split")
    ap.add_argument("--per-file", type=int, default=3, help="max records from one file in a shipped split")
    ap.add_argument("--train-bytes", type=int, default=2_500_000, help="training text cap per domain")
    ap.add_argument("--train-file-bytes", type=int, default=60_000, help="training text cap per file")
    ap.add_argument("--heldout-frac", type=float, default=0.08)
    ap.add_argument("--calib-frac", type=float, default=0.08)
    ap.add_argument("--max-file-bytes", type=int, default=400_000)
    ap.add_argument("--man-pages", type=int, default=900)
    ap.add_argument("--doc-pkg-bytes", type=int, default=150_000)
    a = ap.parse_args(argv)

    t0 = time.time()
    seen = set()
    splits = {"train": [], "calibration": [], "heldout": []}
    stats = {}
    for dom in DOMAINS:
        n_files = 0
        per = {"train": [], "calibration": [], "heldout": []}
        for path, text in GATHER[dom](a):
            n_files += 1
            sp = split_of(dom, path, a.heldout_frac, a.calib_frac)
            for c in chunks_of(text, a.chunk_chars, a.min_chars):
                key = hashlib.sha1(re.sub(r"\s+", " ", c).encode()).digest()
                if key in seen:
                    continue
                seen.add(key)
                per[sp].append({"text": c, "source": dom, "path": path})
        rng = random.Random(f"{a.seed}:{dom}")
        # training: shuffle files, cap bytes per file and per domain
        by_file = {}
        for r in per["train"]:
            by_file.setdefault(r["path"], []).append(r)
        files = sorted(by_file)
        rng.shuffle(files)
        tot, train = 0, []
        for p in files:
            fb = 0
            for r in by_file[p]:
                if fb >= a.train_file_bytes or tot >= a.train_bytes:
                    break
                train.append(r)
                fb += len(r["text"])
                tot += len(r["text"])
            if tot >= a.train_bytes:
                break
        cal = sample_split(per["calibration"], a.per_domain, a.per_file, rng)
        held = sample_split(per["heldout"], a.per_domain, a.per_file, rng)
        splits["train"] += train
        splits["calibration"] += cal
        splits["heldout"] += held
        stats[dom] = {
            "files_read": n_files,
            "chunks": {k: len(v) for k, v in per.items()},
            "train_records": len(train),
            "train_chars": tot,
            "calibration_records": len(cal),
            "heldout_records": len(held),
        }
        print(f"[{time.time() - t0:6.1f}s] {dom}: {json.dumps(stats[dom])}", flush=True)

    os.makedirs(a.out_dir, exist_ok=True)
    os.makedirs(os.path.dirname(a.train_out) or ".", exist_ok=True)
    rng = random.Random(a.seed)
    outs = {
        "train": a.train_out,
        "calibration": os.path.join(a.out_dir, "calibration.jsonl"),
        "heldout": os.path.join(a.out_dir, "heldout.jsonl"),
    }
    for name, recs in splits.items():
        if name == "train":
            rng.shuffle(recs)
        with open(outs[name], "w") as fh:
            for r in recs:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    manifest = {
        "built_by": "scripts/build_corpus.py",
        "args": vars(a),
        "domains": stats,
        "files": {
            k: {"path": v, "records": len(splits[k]), "bytes": os.path.getsize(v), "sha256": sha256_file(v)}
            for k, v in outs.items()
        },
        "note": "Split by file (hash of domain:path): no source file contributes to two splits. "
        "train.jsonl is not shipped; re-derive it with this script.",
    }
    with open(os.path.join(a.out_dir, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
    print(json.dumps(manifest["files"], indent=1))
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
