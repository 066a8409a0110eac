#!/usr/bin/env python3
"""The CUDA kernels' static budget, read from the build's cubins: no GPU.

For every kernel instance in the CUDA objects of a build (the tqkv_cuda
library's .cu.o files; their fatbins hold the sm_90 cubin and its PTX):
registers, spills, stack, shared memory and occupancy on sm_90; and for the
instances budgets.toml lists (a preset on a kernel instance), the SASS warp
instructions per (token, KV head) of the token loop's steady-state iteration
by class (steady_loop.py says how the loop and its path are found), against
the issue's target and the current ceiling.

  sass_budget.py [--build DIR] [--budgets FILE] [--check] [--markdown FILE]

--check exits 1 when an instance spills or exceeds its ceiling (the ctest
Tool.GpuBudget); the targets are reported, not enforced. Exit 77 (a skip)
when the build has no CUDA objects or cuobjdump / nvdisasm / ptxas cannot be
found: scripts/cuda_binutils.sh installs cuobjdump and nvdisasm (PyPI's
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm) into BUILD/cuda-binutils.

Tools are looked up in $TQKV_CUDA_BINUTILS, BUILD/cuda-binutils/nvidia/*/bin,
the PATH, and /usr/local/cuda/bin. Stdlib only.
"""
import argparse
import glob
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import resources  # noqa: E402
import sass  # noqa: E402
import steady_loop  # noqa: E402

SKIP = 77
ARCH = "sm_90"
ROOT = HERE.parent.parent


def find_tool(name, build):
    dirs = [os.environ.get("TQKV_CUDA_BINUTILS", "")]
    dirs += sorted(glob.glob(os.path.join(build, "cuda-binutils", "nvidia", "*", "bin")))
    for d in dirs:
        if d and os.access(os.path.join(d, name), os.X_OK):
            return os.path.abspath(os.path.join(d, name))
    found = shutil.which(name)
    if found:
        return found
    fallback = os.path.join("/usr/local/cuda/bin", name)
    return fallback if os.access(fallback, os.X_OK) else None


# ---------------------------------------------------------------------------
# Kernel names.

def family_names():
    """FormatFamily enumerators in order, from kernels/format_table.h."""
    text = (ROOT / "kernels" / "format_table.h").read_text()
    block = text[text.index("#define TQKV_FORMAT_FAMILIES"):]
    block = block[:block.index("#define TQKV_FORMAT_PAIRS")]
    return re.findall(r"^\s*X\((\w+),", block, re.M)


def short_name(mangled, families):
    """_ZN...15AttendMmaKernelILNS_12FormatFamilyE1ELS3_1ELi128EEEv... ->
    AttendMmaKernel<Bf16, Bf16, 128>."""
    m = re.search(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}(?=\d)", mangled)
    rest = mangled[m.end():] if m else mangled
    m = re.match(r"(\d+)", rest)
    if not m:
        return mangled
    length = int(m.group(1))
    name = rest[len(m.group(1)):len(m.group(1)) + length]
    args = rest[len(m.group(1)) + length:]
    if not args.startswith("I"):
        return name
    values = []
    for family, number in re.findall(r"(?:FormatFamilyE|LS\d_)(\d+)E|Li(\d+)E", args):
        if family:
            i = int(family)
            values.append(families[i] if i < len(families) else family)
        else:
            values.append(number)
    return "%s<%s>" % (name, ", ".join(values))


# ---------------------------------------------------------------------------
# What a build holds.

class Kernel:
    def __init__(self, mangled, name, obj):
        self.mangled = mangled
        self.name = name
        self.obj = obj
        self.usage = {}
        self.ptxas = {}
        self.threads = None
        self.function = None


_MAX_THREADS = re.compile(r"EIATTR_MAX_THREADS\s*\n\s*Format:[^\n]*\n\s*Value:\s*(0x[0-9a-f]+)")


def max_threads(cuobjdump, cubin):
    """{mangled name: __launch_bounds__ threads} from the cubin's .nv.info."""
    out = subprocess.run([cuobjdump, "-elf", cubin], check=True, capture_output=True, text=True).stdout
    threads = {}
    for section in re.split(r"\n(?=\.nv\.info\.)", out):
        if not section.startswith(".nv.info."):
            continue
        name = section.split()[0][len(".nv.info."):]
        m = _MAX_THREADS.search(section)
        if m:
            threads[name] = int(m.group(1), 16)
    return threads


def load_object(obj, tools, tmp, families):
    """The kernels of one object file."""
    work = os.path.join(tmp, os.path.basename(obj))
    stamp = os.path.join(work, ".extracted")
    if not os.path.exists(stamp) or os.path.getmtime(stamp) < os.path.getmtime(obj):
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        for what in ("-xelf", "-xptx"):
            subprocess.run([tools["cuobjdump"], what, "all", os.path.abspath(obj)], cwd=work, check=True,
                           capture_output=True)
        pathlib.Path(stamp).touch()
    cubins = sorted(glob.glob(os.path.join(work, "*%s*.cubin" % ARCH)))
    ptxs = sorted(glob.glob(os.path.join(work, "*.ptx")))
    if not cubins:
        raise RuntimeError("%s holds no %s cubin" % (obj, ARCH))
    kernels = {}
    for cubin in cubins:
        usage = resources.resource_usage(tools["cuobjdump"], cubin)
        threads = max_threads(tools["cuobjdump"], cubin)
        functions = sass.parse(sass.disassemble(tools["nvdisasm"], cubin))
        for mangled, fn in functions.items():
            if mangled not in threads:  # not an entry point
                continue
            k = Kernel(mangled, short_name(mangled, families), os.path.basename(obj))
            k.usage = usage.get(mangled, {})
            k.threads = threads[mangled]
            k.function = fn
            kernels[mangled] = k
    for ptx in ptxs:
        for mangled, report in resources.ptxas_report(tools["ptxas"], ptx, ARCH).items():
            if mangled in kernels:
                kernels[mangled].ptxas = report
    return kernels


# ---------------------------------------------------------------------------
# The two tables.

def dynamic_shared(kernel, head_dim=128):
    """Dynamic shared memory a launch asks for at head_dim 128: the fp32
    and score kernels' AttendSharedBytes(rows, head_dim) (attend_simt_impl.cuh);
    the fp16 kernel's with TurboQuant values, HmmaTablesBytes
    (hmma_fragments_impl.cuh: 8 KiB pair tables, two a warp and one more,
    nine; three a warp with split keys, key bits 43 or 32: thirteen); the
    others take none."""
    m = re.match(r"AttendHmmaKernel<TurboQuant, TurboQuant, \d+, (\d+),", kernel.name)
    if m:
        tables = 3 if int(m.group(1)) >= 10 else 2
        return (tables * 4 + 1) * 8192
    m = re.match(r"(AttendKernel|ScoreKernel)<.*, (\d+)>$", kernel.name)
    if not m:
        return 0
    rows = int(m.group(2))
    return 4 * (rows * head_dim * 2 + 32 + rows * 128)


def resource_rows(kernels, budgets):
    """The table of every kernel instance. Spills: the issue's target is
    none; budgets.toml's [spills] holds what each instance spilled when the
    budget was set (a ratchet, like the ceilings): more, or a spill in an
    instance it does not list, is a problem."""
    rows, problems = [], []
    allowed_spills = budgets.get("spills", {})
    for k in sorted(kernels.values(), key=lambda k: (k.obj, k.name)):
        regs = k.usage.get("REG", 0)
        shared = k.usage.get("SHARED", 0) + dynamic_shared(k)
        blocks, share, limiter = resources.occupancy(regs, shared, k.threads or 128)
        spills = (k.ptxas.get("spill_stores"), k.ptxas.get("spill_loads"))
        allowed = tuple(allowed_spills.get(k.name, (0, 0)))
        if None in spills:
            problems.append("%s: ptxas gave no spill report" % k.name)
        elif spills[0] > allowed[0] or spills[1] > allowed[1]:
            problems.append("%s spills %d bytes stored, %d loaded (allowed: %d, %d)" % (
                k.name, spills[0], spills[1], allowed[0], allowed[1]))
        if k.ptxas.get("registers") not in (None, regs):
            problems.append("%s: ptxas of the PTX used %s registers, the cubin %d: not the build's code" % (
                k.name, k.ptxas.get("registers"), regs))
        spill_text = "%s / %s" % spills + ("" if spills == (0, 0) else " (allowed %d / %d)" % allowed)
        rows.append([k.name, k.obj.replace(".cu.o", ".cu"), str(regs), spill_text,
                     str(k.usage.get("STACK", 0)), str(shared), str(k.threads),
                     "%d (%d%%, %s)" % (blocks, round(100 * share), limiter)])
    header = ["kernel", "source", "registers", "spill bytes (st / ld)", "stack", "shared bytes", "threads",
              "blocks / SM (occupancy, limit)"]
    return header, rows, problems


def loop_rows(kernels, budgets):
    by_name = {k.name: k for k in kernels.values()}
    source = steady_loop.Source()
    measured, rows, problems = {}, [], []
    for inst in budgets["instance"]:
        kernel = by_name.get(inst["kernel"])
        if kernel is None:
            problems.append("%s: no kernel %s in the build" % (inst["preset"], inst["kernel"]))
            continue
        if "pending" in inst:  # listed with its target, not walked yet
            rows.append([inst["preset"], inst["kernel"], "-"] + ["-"] * len(steady_loop.CLASSES) +
                        ["%.1f" % inst["target"], "-", "not walked: " + inst["pending"]])
            continue
        kind = budgets["kind"][inst["kind"]]
        keep = set(inst.get("keep", []))
        config = steady_loop.Config(inst.get("loop", kind["loop"]), [p for p in kind.get("exclude", []) if p not in keep],
                                    kind.get("trips", []) + inst.get("trips", []),
                                    inst.get("pred", []) + kind.get("pred", []) + budgets.get("common", {}).get("pred", []),
                                    inst.get("values", {}), sorted(keep))
        blocks, block_at = sass.blocks_of(kernel.function)
        try:
            path, _, _ = steady_loop.walk(kernel.function, blocks, block_at, source, config)
        except steady_loop.WalkError as e:
            problems.append("%s (%s): %s" % (inst["preset"], inst["kernel"], e))
            continue
        scale = inst.get("warps", 1) / (inst["tokens"] * inst.get("kv_heads", 1))
        counts = steady_loop.class_counts(path)
        per = len(path) * scale
        measured[inst["preset"]] = per
        target = inst.get("target")
        if "recipe_of" in inst and inst["recipe_of"] in measured:
            target = inst["target_ratio"] * measured[inst["recipe_of"]]
        ceiling = inst["ceiling"]
        verdict = "ok" if per <= ceiling else "OVER CEILING"
        if per > ceiling:
            problems.append("%s (%s): %.1f instructions per (token, KV head) > ceiling %.1f" % (
                inst["preset"], inst["kernel"], per, ceiling))
        gap = "" if target is None else (" (target met)" if per <= target else " (%.1fx target)" % (per / target))
        rows.append([inst["preset"], inst["kernel"], "%.1f" % per] +
                    ["%.2f" % (counts[c] * scale) for c in steady_loop.CLASSES] +
                    ["-" if target is None else "%.1f" % target, "%.1f" % ceiling, verdict + gap])
    header = ["preset", "kernel instance", "instr / (token, KV head)"] + list(steady_loop.CLASSES) + \
        ["target", "ceiling", "verdict"]
    return header, rows, problems


def markdown(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=str(ROOT / "build"))
    parser.add_argument("--budgets", default=str(HERE / "budgets.toml"))
    parser.add_argument("--check", action="store_true", help="exit 1 on a spill or a ceiling exceeded")
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--work", help="keep the extracted cubins, PTX and ptxas logs here (reused while newer "
                        "than the objects) instead of a temporary directory")
    args = parser.parse_args(argv)

    objects = sorted(glob.glob(os.path.join(args.build, "kernels", "cuda", "CMakeFiles", "tqkv_cuda.dir", "*.cu.o")))
    if not objects:
        print("sass_budget: SKIPPED: no CUDA objects under %s (built without nvcc?)" % args.build)
        return SKIP
    tools = {name: find_tool(name, args.build) for name in ("cuobjdump", "nvdisasm", "ptxas")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        print("sass_budget: SKIPPED: %s not found; scripts/cuda_binutils.sh installs cuobjdump and nvdisasm "
              "into %s/cuda-binutils (ptxas comes with nvcc)" % (", ".join(missing), args.build))
        return SKIP
    with open(args.budgets, "rb") as f:
        budgets = tomllib.load(f)
    families = family_names()
    kernels = {}
    with tempfile.TemporaryDirectory(prefix="sass_budget.") as tmp:
        work = args.work or tmp
        for obj in objects:
            kernels.update(load_object(obj, tools, work, families))
    res_header, res_rows, res_problems = resource_rows(kernels, budgets)
    loop_header, loop_rows_, loop_problems = loop_rows(kernels, budgets)
    text = "\n".join([
        "Tools: " + ", ".join("%s %s" % (n, p) for n, p in tools.items()),
        "",
        "Steady-state token loop, warp instructions per (token, KV head), %s (static count, no GPU):" % ARCH,
        "",
        markdown(loop_header, loop_rows_),
        "",
        "Every kernel instance (shared bytes: static plus dynamic, see dynamic_shared):",
        "",
        markdown(res_header, res_rows),
    ])
    print(text)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text + "\n")
    problems = res_problems + loop_problems
    for p in problems:
        print("sass_budget: FAIL: " + p)
    if args.check and problems:
        return 1
    print("sass_budget: %d kernel instances, %d budgeted loops, %d problems" % (
        len(kernels), len(loop_rows_), len(problems)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
