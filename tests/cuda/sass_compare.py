#!/usr/bin/env python3
"""Per-kernel comparison of two builds of cuda/*.cu: sm_90 SASS and ptxas resources.

For a change of shape (moving code, splitting a kernel into device functions,
renaming): every kernel's machine code must stay as it was
(docs/cuda-design.md, "Changing the code").

  tests/cuda/sass_compare.py BASE_REV [--arch sm_90] [--define NAME] [--show KERNEL] [--rename OLD=NEW]

builds every cuda/*.cu of git revision BASE_REV and of the work tree (each to
its own object, as setup.py does, with -Xptxas -v), then prints one line per
kernel:
  identical        same instructions, encodings and resources (registers,
                   shared memory, stack, spills);
  cbank-only(N)    the same instructions but for N constant-bank operands
                   (c[0x0] kernel parameters, c[0x4] module memory addresses)
                   that moved, e.g. a parameter struct that grew, or module
                   memory reached through a parameter; "+RES" when the
                   resources differ too;
  SASS DIFFERS     anything else (--show KERNEL prints the diff).
Needs nvcc, cuobjdump and nvdisasm on PATH. Exit status 0 only when every
kernel is identical.
"""
import argparse
import difflib
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENC = re.compile(r"/\* 0x[0-9a-f]{16} \*/")


def build(src_dir, out_dir, arch, defines):
    """Objects and ptxas reports of every src_dir/cuda/*.cu."""
    objs, reports = [], []
    for cu in sorted(glob.glob(os.path.join(src_dir, "cuda", "*.cu"))):
        obj = os.path.join(out_dir, os.path.basename(cu) + ".o")
        cmd = ["nvcc", "-c", cu, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
               "--expt-relaxed-constexpr", "-I" + os.path.join(src_dir, "csrc"),
               f"-gencode=arch=compute_{arch[3:]},code={arch}", "-Xptxas", "-v"]
        cmd += ["-D" + d for d in defines]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"{' '.join(cmd)}\n{res.stderr}")
        objs.append(obj)
        reports.append(res.stderr)
    return objs, reports


def sass(objs, arch):
    funcs = {}
    for o in objs:
        out = subprocess.run(["cuobjdump", "-sass", "-arch", arch, o], capture_output=True, text=True,
                             check=True).stdout
        cur = None
        for line in out.splitlines():
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                cur = m.group(1)
                if cur in funcs:
                    sys.exit(f"{cur} is defined in two translation units")
                funcs[cur] = []
                continue
            s = re.sub(r"\s+", " ", line.strip())
            if cur is None or not s or s.startswith(("....", "=====", "arch =", "code version", "host =",
                                                      "compile_size", "code for")):
                continue
            if s.startswith("Fatbin"):
                cur = None
                continue
            funcs[cur].append(s)
    return funcs


def resources(reports):
    res = {}
    for text in reports:
        cur = None
        for line in text.splitlines():
            m = re.search(r"Function properties for (\S+)", line)
            if m:
                cur = m.group(1)
                res[cur] = []
            elif cur and ("bytes stack frame" in line or "ptxas info    : Used" in line):
                res[cur].append(re.sub(r"^ptxas info\s*:\s*", "", line.strip()))
    return res


def classify(a, b):
    """'identical', 'cbank-only(N)' or 'SASS DIFFERS'."""
    if a == b:
        return "identical"
    if len(a) == len(b):
        def cb(s):
            return re.sub(r"c\[0x[04]\]\[[^\]]*\]", "c[*]", ENC.sub("", s)).strip()

        diffs = [(x, y) for x, y in zip(a, b) if x != y]
        if all(cb(x) == cb(y) for x, y in diffs):
            return f"cbank-only({sum(1 for x, _ in diffs if not ENC.fullmatch(x))})"
    return "SASS DIFFERS"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base_rev")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--define", action="append", default=[], help="e.g. IMOE_PHASE_TIMES")
    ap.add_argument("--show", action="append", default=[])
    ap.add_argument("--rename", action="append", default=[], help="OLD=NEW mangled kernel name")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_src = os.path.join(tmp, "base")
        os.makedirs(base_src)
        tar = subprocess.run(["git", "-C", ROOT, "archive", a.base_rev, "cuda", "csrc"], capture_output=True,
                             check=True).stdout
        subprocess.run(["tar", "-x", "-C", base_src], input=tar, check=True)
        os.makedirs(os.path.join(tmp, "b"))
        os.makedirs(os.path.join(tmp, "n"))
        bo, br = build(base_src, os.path.join(tmp, "b"), a.arch, a.define)
        no, nr = build(ROOT, os.path.join(tmp, "n"), a.arch, a.define)
        ren = dict(r.split("=", 1) for r in a.rename)
        b = {ren.get(k, k): v for k, v in sass(bo, a.arch).items()}
        bres = {ren.get(k, k): v for k, v in resources(br).items()}
        n, nres = sass(no, a.arch), resources(nr)
    bad = 0
    for k in sorted(set(b) | set(n)):
        if k not in b or k not in n:
            print(f"{'only in base' if k in b else 'only in new':17s} {k}")
            bad += 1
            continue
        tag = classify(b[k], n[k])
        if bres.get(k) != nres.get(k):
            tag += "+RES" if tag != "identical" else ""
            tag = tag if tag != "identical" else "RESOURCES DIFFER"
        print(f"{tag:17s} {k}")
        if bres.get(k) != nres.get(k):
            print(f"    base: {bres.get(k)}\n    new:  {nres.get(k)}")
        if tag != "identical":
            bad += 1
            if k in a.show:
                for line in difflib.unified_diff(b[k], n[k], lineterm="", n=2):
                    print("   ", line)
    print(f"{len(set(b) | set(n))} kernels, {bad} not identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
