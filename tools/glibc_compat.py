"""Lower the glibc versions an x86-64 shared object asks for, in place.

A library linked on a new glibc asks for the version each symbol has there.
glibc 2.34 moved libpthread, libdl and librt into libc.so.6 and gave the moved
symbols a new version (pthread_create@GLIBC_2.34, dlopen@GLIBC_2.34; 2.32 did
the same for pthread_*affinity_np), although the functions are the ones older
glibcs export under their old versions, which new glibcs keep as
compatibility symbols. The static CUDA runtime and Debian's libgomp reach
these symbols, so an object linked on Debian 12 needs glibc 2.34, whatever the
code it calls.

For every undefined symbol that asks for a glibc version newer than --glibc,
this rewrites the request to the newest version of that symbol at or below
--glibc that the build machine's own library still exports (what a build on
that older glibc would have recorded). When the object's string table lacks
that version's name, the request becomes unversioned instead, which binds the
default version on the machine that loads it: the same function. The version
entries left unused are renamed to a version the object already needs, so
nothing newer than --glibc remains. Symbols that exist only in newer glibcs
(new functions, not moved ones) cannot be lowered: they are listed and the
exit status is 1, leaving the file unchanged.

The moved symbols live in libpthread.so.0, libdl.so.2 and librt.so.1 on a
glibc older than 2.34, so the caller adds those as NEEDED entries (patchelf
--add-needed; tools/build_wheel.sh does) when this reports a 2.34 symbol.

    python tools/glibc_compat.py --glibc 2.28 FILE...

Only the ELF64 little-endian layout (x86-64) is handled.
"""

from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import sys

LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")


def _version(name: str) -> tuple | None:
    m = re.fullmatch(r"GLIBC_(\d+(?:\.\d+)+)", name)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def _cstr(data: bytes, off: int) -> str:
    return data[off:data.index(b"\0", off)].decode()


def _elf_hash(name: str) -> int:
    h = 0
    for c in name.encode():
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h


def _sections(data: bytes) -> dict:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not an ELF64 little-endian file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = heads[shstrndx][4]
    return {_cstr(data, names_off + h[0]): {"offset": h[4], "size": h[5], "link": h[6]} for h in heads}


def _exported_versions(lib: str) -> dict:
    """{symbol: {version tuple, ...}} of the GLIBC versions `lib` defines, default or not."""
    out = subprocess.run(["objdump", "-T", lib], capture_output=True, text=True, check=True).stdout
    versions: dict = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 3 or "*UND*" in fields:
            continue
        v = _version(fields[-2].strip("()"))
        if v is not None:
            versions.setdefault(fields[-1], set()).add(v)
    return versions


def _find_lib(soname: str) -> str:
    for d in LIB_DIRS:
        path = os.path.join(d, soname)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{soname} not found in {', '.join(LIB_DIRS)}")


def lower(path: str, target: tuple) -> dict:
    """Rewrites `path`; returns {"lowered": [(symbol, old, new)], "blocked": [(symbol, version)]}."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    sec = _sections(bytes(data))
    dynsym, versym, verneed = sec[".dynsym"], sec[".gnu.version"], sec[".gnu.version_r"]
    dynstr = sec[".dynstr"]["offset"]
    strtab = bytes(data[dynstr:dynstr + sec[".dynstr"]["size"]])

    # Every version request: index -> [entry offset, file, name]; the entries per file.
    requests, by_file = {}, {}
    vn = verneed["offset"]
    while True:
        _, cnt, file_off, aux_off, next_off = struct.unpack_from("<HHIII", data, vn)
        file = _cstr(strtab, file_off)
        aux = vn + aux_off
        for _ in range(cnt):
            _, _, other, name_off, aux_next = struct.unpack_from("<IHHII", data, aux)
            requests[other] = [aux, file, _cstr(strtab, name_off)]
            by_file.setdefault(file, []).append(other)
            aux += aux_next
        if not next_off:
            break
        vn += next_off
    too_new = {i for i, (_, _, name) in requests.items() if (_version(name) or ()) > target}
    if not too_new:
        return {"lowered": [], "blocked": []}

    exported = {}
    lowered, blocked, assign = [], [], {}
    count = dynsym["size"] // 24
    for i in range(1, count):
        index = struct.unpack_from("<H", data, versym["offset"] + 2 * i)[0] & 0x7FFF
        if index not in too_new:
            continue
        _, file, new_name = requests[index]
        name = _cstr(strtab, struct.unpack_from("<I", data, dynsym["offset"] + 24 * i)[0])
        if file not in exported:
            exported[file] = _exported_versions(_find_lib(file))
        older = [v for v in exported[file].get(name, ()) if v <= target]
        if not older:
            blocked.append((name, new_name))
            continue
        assign[i] = (name, new_name, "GLIBC_" + ".".join(map(str, max(older))))
    if blocked:
        return {"lowered": [], "blocked": blocked}

    def index_of(version: str, file: str = "libc.so.6") -> int | None:
        usable = [i for i, (_, f, n) in requests.items() if n == version and i not in too_new]
        return next((i for i in usable if requests[i][1] == file), usable[0] if usable else None)

    # Versions the object does not ask for yet take over an entry that falls
    # out of use, where the string table already holds their name.
    spare = sorted(too_new)
    for _, _, old in assign.values():
        if index_of(old) is None and spare and strtab.find(b"\0" + old.encode() + b"\0") >= 0:
            idx = spare.pop(0)
            name_off = strtab.index(b"\0" + old.encode() + b"\0") + 1
            struct.pack_into("<IHHI", data, requests[idx][0], _elf_hash(old), 0, idx, name_off)
            requests[idx][2] = old
            too_new.discard(idx)
    for i, (name, new_name, old) in assign.items():
        idx = index_of(old, requests[struct.unpack_from("<H", data, versym["offset"] + 2 * i)[0] & 0x7FFF][1])
        struct.pack_into("<H", data, versym["offset"] + 2 * i, idx if idx is not None else 1)
        lowered.append((name, new_name, old if idx is not None else "unversioned"))
    # What is left unused becomes a copy of a request the same file already makes.
    for idx in too_new:
        aux, file, _ = requests[idx]
        keep = next((i for i in by_file[file] if i not in too_new and _version(requests[i][2])), None)
        if keep is None:
            raise ValueError(f"{path}: every glibc version asked of {file} is newer than the target")
        keep_aux, _, keep_name = requests[keep]
        _, _, _, name_off, _ = struct.unpack_from("<IHHII", data, keep_aux)
        struct.pack_into("<IHHI", data, aux, _elf_hash(keep_name), 0, idx, name_off)
    with open(path, "wb") as f:
        f.write(data)
    return {"lowered": lowered, "blocked": []}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--glibc", required=True, help="the oldest glibc to load on, e.g. 2.28")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    target = _version("GLIBC_" + args.glibc)
    status = 0
    for path in args.files:
        result = lower(path, target)
        for name, new, old in result["lowered"]:
            print(f"{path}: {name}@{new} -> {old}")
        for name, new in result["blocked"]:
            print(f"{path}: {name}@{new} has no version at or below GLIBC_{args.glibc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
