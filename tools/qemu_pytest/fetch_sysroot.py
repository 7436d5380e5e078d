#!/usr/bin/env python3
"""Resolve and download Debian 12 arm64 .debs from the mirror (no dpkg/apt arch changes), then
extract them into a private sysroot with dpkg-deb -x.  usage: fetch_sysroot.py PACKAGES DEBDIR ROOT"""

import os
import re
import subprocess
import sys
import urllib.request

pk, debdir, root = sys.argv[1:4]
MIRROR = "http://deb.debian.org/debian/"
SEEDS = """libc6 libgcc-s1 libstdc++6 libgomp1 python3.11-minimal libpython3.11-minimal
libpython3.11-stdlib python3.11 libpython3.11-dev python3.11-dev zlib1g libexpat1 libffi8 libssl3
libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libuuid1 libdb5.3 libgdbm6
libnsl2 libtirpc3 libcrypt1 python3-numpy libblas3 liblapack3 libgfortran5 python3-minimal python3""".split()
# Never pulled in: maintainer-script machinery and things the tests do not need.
SKIP = set(
    """debconf dpkg perl-base tzdata media-types mime-support install-info readline-common
python3-pkg-resources python3-distutils python3-lib2to3 libc-dev-bin linux-libc-dev libc6-dev
libcrypt-dev libnsl-dev libtirpc-dev libexpat1-dev zlib1g-dev libpython3-dev python3-dev
libpython3-stdlib python3.11-venv netbase libkrb5-3 libgssapi-krb5-2 libk5crypto3 libkrb5support0
libcom-err2 libkeyutils1 gcc-12-base libtirpc-common debianutils coreutils dpkg-dev
""".split()
)
pkgs = {}
for stanza in open(pk, encoding="utf-8").read().split("\n\n"):
    f = dict(re.findall(r"^([\w-]+): (.*)$", stanza, re.M))
    if "Package" in f:
        pkgs.setdefault(f["Package"], f)
        for p in f.get("Provides", "").split(","):
            p = p.strip().split(" ")[0]
            if p:
                pkgs.setdefault("virt:" + p, f)
want, todo = {}, list(SEEDS)
while todo:
    n = todo.pop()
    if n in want or n in SKIP:
        continue
    f = pkgs.get(n) or pkgs.get("virt:" + n)
    if f is None:
        print("not found:", n)
        continue
    if f["Package"] in SKIP or f["Package"] in want:
        continue
    want[f["Package"]] = f
    for field in ("Pre-Depends", "Depends"):
        for alt in f.get(field, "").split(","):
            alt = alt.strip()
            if not alt:
                continue
            first = alt.split("|")[0].strip().split(" ")[0].split(":")[0]
            todo.append(first)
os.makedirs(debdir, exist_ok=True)
os.makedirs(root, exist_ok=True)
for name, f in sorted(want.items()):
    dst = os.path.join(debdir, os.path.basename(f["Filename"]))
    if not os.path.exists(dst):
        urllib.request.urlretrieve(MIRROR + f["Filename"], dst + ".part")
        os.rename(dst + ".part", dst)
    subprocess.run(["dpkg-deb", "-x", dst, root], check=True)
    print(name, f["Version"])
