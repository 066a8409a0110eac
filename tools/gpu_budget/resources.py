"""Registers, spills, shared memory and occupancy of each kernel in a build.

Registers, stack and static shared memory come from `cuobjdump -res-usage`
of the build's cubin. Spills: ptxas reports them and the cubin does not
(its STACK also holds local arrays, e.g. sinf's large-argument reduction),
so the PTX the build embeds next to the cubin is compiled again with
`ptxas -v` for the same architecture; its register counts must equal the
cubin's, which shows it is the same code.

Occupancy: resident thread blocks per SM from registers (allocated per warp
in units of 256), shared memory (static + dynamic + 1 KiB reserved per
block, in units of 128 bytes) and threads, with sm_90's limits.
"""
import os
import re
import subprocess

SM90 = {
    "registers": 65536,
    "shared": 228 * 1024,
    "threads": 2048,
    "blocks": 32,
    "warps": 64,
    "reserved_shared": 1024,
    "register_unit": 256,
    "shared_unit": 128,
}

_RES_FUNCTION = re.compile(r"^\s*Function (\S+):\s*$")
_RES_VALUES = re.compile(r"(\w+(?:\[\d+\])?):(\d+)")


def resource_usage(cuobjdump, cubin):
    """{mangled name: {REG, STACK, SHARED, LOCAL, ...}} from -res-usage."""
    out = subprocess.run([cuobjdump, "-res-usage", cubin], check=True, capture_output=True, text=True).stdout
    usage, current = {}, None
    for line in out.splitlines():
        m = _RES_FUNCTION.match(line)
        if m:
            current = m.group(1)
            continue
        if current and "REG:" in line:
            usage[current] = {k: int(v) for k, v in _RES_VALUES.findall(line)}
            current = None
    return usage


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def ptxas_report(ptxas, ptx, arch):
    """{mangled name: {registers, stack, spill_stores, spill_loads}} of
    `ptxas -v` over the PTX file (its log kept next to it, and reused while
    newer than the PTX)."""
    log = ptx + ".ptxas.txt"
    if not os.path.exists(log) or os.path.getmtime(log) < os.path.getmtime(ptx):
        run = subprocess.run([ptxas, "-arch=" + arch, "-O3", "-v", ptx, "-o", "/dev/null"], capture_output=True,
                             text=True)
        if run.returncode != 0:
            raise RuntimeError("ptxas failed: " + run.stderr[-2000:])
        with open(log, "w") as f:
            f.write(run.stderr)
    with open(log) as f:
        text = f.read()
    report, current = {}, None
    for line in text.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            current = report.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        m = _PTXAS_SPILL.search(line)
        if m:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _PTXAS_REGS.search(line)
        if m:
            current["registers"] = int(m.group(1))
    return report


def occupancy(registers, shared_bytes, threads, limits=SM90):
    """(blocks per SM, resident warps / max warps, limiting resource)."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // limits["register_unit"]) * limits["register_unit"]
    by_regs = (limits["registers"] // per_warp) // warps if per_warp else limits["blocks"]
    shared = shared_bytes + limits["reserved_shared"]
    shared = -(-shared // limits["shared_unit"]) * limits["shared_unit"]
    by_shared = limits["shared"] // shared
    by_threads = limits["threads"] // threads
    options = [(by_regs, "registers"), (by_shared, "shared"), (by_threads, "threads"), (limits["blocks"], "blocks")]
    blocks, limiter = min(options, key=lambda o: o[0])
    return blocks, blocks * warps / limits["warps"], limiter
