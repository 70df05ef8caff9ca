"""The sm_90 hardware report of the StatNorm layers' Triton kernels, built on the CPU (benchmarks/sm90_report.py
is its command line; tests/kernels/test_sm90_report.py runs it in CI and fails on its violations).

1. Record (tests/kernels/sm90_record.py): for every layer case, setting (bf16, fp16, fp32, fp64, bf16 under
   autocast, channels_last) and level (FPN P2-P7 at 2 x 256 channels, N256: 256 images at 7x7), one training
   step and one eval forward, each launch specialized by Triton's own launcher code for sm_90.
2. Compile (tests/kernels/sm90_compile.py): each distinct variant once (the sizes are do_not_specialize, so
   the levels share variants), reading from its TTIR and PTX which pointer arguments it streams over and how
   wide its accesses are, registers and spills from ptxas, fp64 approximations.
3. Per step: launches (Triton + the ATen operators between them, each a CUDA launch; ``set_``, which only
   re-points a tensor, excluded) and the activation bytes moved: per launch, every activation-sized tensor
   argument (as many elements as x) that the kernel reads by a block (tile) load counts its bytes once,
   every one it writes by a block store likewise (a second pass over the same tensor inside one kernel
   would not show); per ATen operator (a layout copy of a channels_last x or dy, a dtype conversion of dy),
   its activation-sized inputs and outputs. As a multiple of x's bytes. A training step is the forward and
   ``torch.autograd.grad`` of the output with dy in y's dtype and x's layout (what a network hands back).

Checks (``CHECKS``): each a list of violations, reported separately."""
import collections
import time

import torch

from tests.kernels import sm90_compile as S
from tests.kernels import sm90_record as R

MAX_LAUNCHES = 6  # per training step (forward + backward), Triton and ATen together
MAX_ACT_BYTES = 8.0  # activation bytes per training step, in multiples of x's bytes
CHECKS = {
    'calibration': 'the access analysis reads real compiler output right (an aligned and an unaligned copy)',
    'recorded': 'every step took the Triton path (launches in its forward and backward)',
    'compiles': 'every variant compiles for sm_90',
    'sizes_do_not_specialize': 'size arguments are do_not_specialize (a new size never recompiles)',
    'vector_access': 'no scalar (1 element per instruction) block access of an activation-sized tensor',
    'spills': 'no register spills',
    'fp64_approx': 'no approximate instruction on float64',
    'launches': f'at most {MAX_LAUNCHES} launches (Triton + ATen) per training step',
    'activation_bytes': f'at most {MAX_ACT_BYTES:g}x the activation bytes per training step',
}


def _fmt(value):
    return getattr(value, 'name', None) or str(value).replace('triton.language.', 'tl.')


def _types(signature):
    """Signature types, a tuple argument's (the map kernels' folded first stage) flattened."""
    for t in signature:
        yield from (_types(t) if isinstance(t, tuple) else [t])


def _describe(variant):
    """JSON-able description: kernel, constexprs, pointer types, the specialized integer arguments (a tuple
    argument's elements named ``name.i``)."""
    params = [p.name for p in variant['fn'].params]

    def name(path):
        return '.'.join([params[path[0]]] + [str(i) for i in path[1:]])

    def sig(path):
        t = variant['signature'][params[path[0]]]
        for i in path[1:]:
            t = t[i]
        return t
    consts = {name(path): _fmt(v) for path, v in variant['constexprs'].items()}
    fixed = sorted(name(path) for path in variant['constexprs']
                   if len(path) > 1 or not variant['fn'].params[path[0]].is_constexpr)
    divisible = sorted(name(path) for path, a in variant['attrs'].items()
                       if any(x[0] == 'tt.divisibility' for x in a) and not sig(path).startswith('*'))
    return dict(kernel=variant['name'], module=variant['fn'].fn.__module__, constexprs=consts,
                value_1_specialized=fixed, divisible_16_ints=divisible, num_warps=variant['options'].num_warps,
                pointer_types=sorted({t[1:] for t in _types(variant['signature'].values()) if t.startswith('*')}))


def record(settings, cases, levels, recorder):
    steps = {}
    factories = R.layer_cases()
    with recorder.active():
        for setting in settings:
            for case in cases:
                # once per process costs (GN+PN's proxy quantiles, cached per dtype) are not a step's: warm up
                start = len(recorder.launches)
                R.record_step(recorder, factories[case], setting, R.LEVELS[levels[0]], R.batch(levels[0]))
                del recorder.launches[start:]
                for level in levels:
                    steps[(case, setting, level)] = R.record_step(recorder, factories[case], setting,
                                                                  R.LEVELS[level], R.batch(level))
    return steps


def analyse_variants(recorder):
    """{key: report entry} of every distinct variant: compiled once, whatever level recorded it."""
    out = {}
    used = collections.defaultdict(lambda: dict(launches=0, act=set()))
    for launch in recorder.launches:
        u = used[launch['key']]
        u['launches'] += 1
        u['act'] |= {n for n, t in launch['tensors'].items() if t['act']}
    for key, variant in recorder.variants.items():
        entry = _describe(variant)
        c = S.compile_variant(variant, recorder.target)
        entry.update(compiles=c['ok'], error=c['error'], compile_s=round(c['seconds'], 2),
                     launches_recorded=used[key]['launches'], activation_args=sorted(used[key]['act']))
        if c['ok']:
            regs, spill_st, spill_ld = S.ptxas_resources(c['ptxas'])
            args, unmatched = S.memory_accesses(c['ttir'], c['ptx'])
            entry.update(registers=regs, spill_stores=spill_st, spill_loads=spill_ld, shared=c['shared'],
                         fp64_approx=S.fp64_approx(c['ptx']), unattributed_ptx=unmatched,
                         access={n: {k: x for k, x in a.items() if x and k != 'itemsize'}  # what it has only
                                 for n, a in args.items() if a['load'] or a['store'] or a['single']})
        out[key] = entry
    return out


def _launch_bytes(launch, variant):
    """(read, written) bytes of activation-sized tensors by one launch (block accesses per the kernel's TTIR)."""
    read = written = 0
    access = variant.get('access') or {}
    for name, t in launch['tensors'].items():
        if t['act'] and name in access:
            size = t['numel'] * t['itemsize']
            read += size if access[name].get('load') else 0
            written += size if access[name].get('store') else 0
    return read, written


def summarize_step(step, variants):
    """Per phase: Triton launches, ATen operators, activation bytes (multiple of x's) and each launch with
    what it moves ('_dx_kernel R2 W1': reads 2x, writes 1x x's bytes); the training step's totals."""
    x_bytes = step['x_bytes']
    out = dict(x_layout=step['x_layout'], y_dtype=step['y_dtype'], y_layout=step['y_layout'],
               dx_layout=step['dx_layout'])

    def moved(name, r, w):
        return name + (f' R{r / x_bytes:g} W{w / x_bytes:g}' if r or w else '')

    for phase in ('forward', 'backward', 'eval'):
        items, total = [], 0
        for launch in step[phase]['launches']:
            r, w = _launch_bytes(launch, variants[launch['key']])
            total += r + w
            items.append(moved(launch['name'], r, w))
        ops = [op for op in step[phase]['aten'] if op['op'] not in R._METADATA]
        for op in ops:
            total += op['read'] + op['written']
            items.append(moved('aten.' + op['op'], op['read'], op['written']))
        out[phase] = dict(triton=len(step[phase]['launches']), aten=len(ops), act_bytes_x=round(total / x_bytes, 3),
                          launches=', '.join(items))
    f, b = out['forward'], out['backward']
    out['train'] = dict(triton=f['triton'] + b['triton'], aten=f['aten'] + b['aten'],
                        launches=f['triton'] + b['triton'] + f['aten'] + b['aten'],
                        act_bytes_x=round(f['act_bytes_x'] + b['act_bytes_x'], 3))
    return out


def violations(steps, variants, fns):
    """{check: [violation]} of the summarized steps, the analysed variants and the kernels (JITFunctions)."""
    v = {name: [] for name in CHECKS}
    per_level = collections.defaultdict(list)  # (check, case setting, message) -> levels: one line for all
    for s in steps:
        where = f"{s['case']} {s['setting']}"
        if not (s['forward']['triton'] and s['backward']['triton']):
            why = 'no Triton launch in forward or backward (the ATen path ran)'
            per_level[('recorded', where, why)].append(s['level'])
        t = s['train']
        if t['launches'] > MAX_LAUNCHES:
            ops = collections.Counter(n for p in ('forward', 'backward') for n in s[p]['launches'].split(', ')
                                      if n.startswith('aten.'))
            aten = ', '.join(f'{n.split()[0]} x{k}' for n, k in ops.items())
            per_level[('launches', where, f"{t['launches']} ({t['triton']} Triton + {t['aten']} ATen"
                       f"{': ' + aten if aten else ''})")].append(s['level'])
        if t['act_bytes_x'] > MAX_ACT_BYTES:
            per_level[('activation_bytes', where, f"{t['act_bytes_x']:g}x ({s['forward']['launches']}; "
                       f"{s['backward']['launches']})")].append(s['level'])
    for (check, where, message), levels in per_level.items():
        v[check].append(f"{where} {','.join(levels)}: {message}")
    for fn in sorted(fns, key=lambda f: f.fn.__qualname__):
        bad = S.specialized_sizes(fn)
        if bad:
            v['sizes_do_not_specialize'].append(f'{fn.fn.__module__}.{fn.fn.__name__}: {bad} not do_not_specialize')
    for e in variants.values():
        label = f"{e['kernel']} {e['constexprs']} {e['pointer_types']}"
        if not e['compiles']:
            v['compiles'].append(f"{label}: {e['error']}")
            continue
        if e['registers'] is None or e['spill_stores'] is None:
            v['spills'].append(f'{label}: ptxas reported no resource usage')
        elif e['spill_stores'] or e['spill_loads']:
            v['spills'].append(f"{label}: {e['spill_stores']} B spill stores, {e['spill_loads']} B spill loads "
                               f"({e['registers']} registers)")
        if e['fp64_approx']:
            kinds = sorted({i.split()[0] for i in e['fp64_approx']})
            v['fp64_approx'].append(f"{label}: {len(e['fp64_approx'])} x {kinds}")
        for name in e['activation_args']:
            a = e['access'].get(name, {})
            for kind in ('load', 'store'):
                if not a.get(kind):
                    continue
                elems = a.get(f'{kind}_elems')
                if elems is None:
                    v['vector_access'].append(f'{label}: {kind} of {name} matched to no PTX instruction')
                elif elems <= 1:
                    v['vector_access'].append(f"{label}: {kind} of {name} ({a['elt']}) {a.get(f'{kind}_bytes')} B = "
                                              f"1 element per instruction")
        if e['activation_args'] and e['unattributed_ptx']:
            v['vector_access'].append(f"{label}: global accesses matched to no TTIR access: "
                                      f"{e['unattributed_ptx'][:3]}")
    return v


def build(settings=None, cases=None, levels=None, arch=90):
    """The report (a JSON-able dict): settings, timing, variants, layers (per case and setting: [Triton launches,
    ATen operators, activation bytes / x's] of the training step and the eval forward per level, and the
    launch lists with the levels they hold at), violations."""
    import triton
    settings = settings or list(R.DTYPES) + list(R.EXTRA)
    cases = cases or sorted(R.layer_cases())
    levels = levels or list(R.LEVELS)
    recorder = R.Recorder(arch)
    t0 = time.time()
    steps = record(settings, cases, levels, recorder)
    t1 = time.time()
    variants = analyse_variants(recorder)
    t2 = time.time()
    by_level = collections.defaultdict(set)
    for (case, setting, level), step in steps.items():
        for phase in ('forward', 'backward', 'eval'):
            by_level[level] |= {launch['key'] for launch in step[phase]['launches']}
    report = dict(
        settings=dict(arch=f'sm_{arch}', triton=triton.__version__, torch=torch.__version__, n=R.N,
                      channels=R.CHANNELS, groups=R.GROUPS, levels={lv: R.LEVELS[lv] for lv in levels},
                      batch={lv: R.batch(lv) for lv in levels},
                      settings=settings, cases=cases),
        timing=dict(record_s=round(t1 - t0, 1), compile_s=round(t2 - t1, 1), steps=len(steps),
                    launches_recorded=len(recorder.launches), variants=len(variants),
                    variants_per_level={lv: len(by_level[lv]) for lv in levels},
                    variants_per_kernel=dict(collections.Counter(e['kernel'] for e in variants.values()))),
        variants=sorted(variants.values(), key=lambda e: (e['kernel'], str(e['constexprs']), str(e['pointer_types']))),
        layers=[])
    flat = [dict(case=c, setting=s, level=lv, **summarize_step(st, variants)) for (c, s, lv), st in steps.items()]
    rows = {}
    for st in flat:  # per layer case and setting: the numbers per level, each distinct launch list once
        row = rows.setdefault((st['case'], st['setting']), dict(
            case=st['case'], setting=st['setting'],
            **{k: st[k] for k in ('x_layout', 'y_dtype', 'y_layout', 'dx_layout')},
            levels={}, launches={}))
        row['levels'][st['level']] = {p: [st[p]['triton'], st[p]['aten'], st[p]['act_bytes_x']]
                                      for p in ('train', 'eval')}
        for p in ('forward', 'backward', 'eval'):
            row['launches'].setdefault(p, {}).setdefault(st[p]['launches'], []).append(st['level'])
    report['layers'] = list(rows.values())
    report['violations'] = violations(flat, variants, {v['fn'] for v in recorder.variants.values()})
    report['violations']['calibration'] = S.calibrate(recorder.target)
    report['violations'] = {name: report['violations'][name] for name in CHECKS}
    return report


# --- markdown -----------------------------------------------------------------------------------------------
def _elems(e, kind):
    """The narrowest block access of a variant's activation-sized arguments: 'B bytes (E el.)'."""
    access = e.get('access', {})
    widths = [(access[n][f'{kind}_bytes'], access[n][f'{kind}_elems']) for n in e['activation_args']
              if access.get(n, {}).get(f'{kind}_bytes')]
    if not widths:
        return '-'
    b, el = min(widths)
    return f'{b} B ({el:g})'


def markdown(report):
    t, s = report['timing'], report['settings']
    per_level = ', '.join(f'{k} {n}' for k, n in t['variants_per_level'].items())
    batch = s.get('batch', {})
    levels = ', '.join(f'{k} {h}x{w}' + (f' ({batch[k]} images)' if batch.get(k, s['n']) != s['n'] else '')
                       for k, (h, w) in s['levels'].items())
    lines = [f"sm_90 report: {s['n']} x {s['channels']} channels ({s['groups']} groups where grouped), levels "
             f"{levels}; triton {s['triton']}, torch "
             f"{s['torch']}. {t['steps']} steps recorded ({t['launches_recorded']} launches), {t['variants']} "
             f"distinct variants compiled (per level: {per_level}: "
             f"the sizes are do_not_specialize, so the FPN levels share them; a classification batch takes "
             f"its own tiles of samples and dx's second stage).", '',
             '| check | violations | first |', '|---|---|---|']
    for name, what in CHECKS.items():
        found = report['violations'][name]
        lines.append(f"| {what} | {len(found) or 'none'} | {found[0].replace('|', '/') if found else ''} |")
    lines += ['', 'Kernel variants, grouped by kernel and pointer types: the narrowest load / store of an '
              'activation-sized tensor per PTX instruction (bytes, elements), registers, spills, fp64 '
              'approximations.', '',
              '| kernel | pointer types | variants | act. load | act. store | registers | spills (B) | fp64 .approx |',
              '|---|---|---|---|---|---|---|---|']
    groups = collections.defaultdict(list)
    for e in report['variants']:
        groups[(e['kernel'], ' '.join(e['pointer_types']))].append(e)
    for (kernel, types), es in sorted(groups.items()):
        ok = [e for e in es if e['compiles']]
        regs = sorted({e['registers'] for e in ok if e['registers'] is not None})
        loads = sorted({_elems(e, 'load') for e in ok})
        stores = sorted({_elems(e, 'store') for e in ok})
        spills = max([(e['spill_stores'] or 0) + (e['spill_loads'] or 0) for e in ok] or [0])
        approx = sum(len(e['fp64_approx']) for e in ok)
        fails = len(es) - len(ok)
        lines.append(f"| {kernel} | {types} | {len(es)}{f' ({fails} fail)' if fails else ''} | {', '.join(loads)} | "
                     f"{', '.join(stores)} | {regs[0] if regs else '?'}-{regs[-1] if regs else '?'} | {spills} | "
                     f"{approx or ''} |")
    levels = list(s['levels'])
    lines += ['', 'Training step (forward + backward) per layer case and setting: launches (Triton + ATen) / '
              'activation bytes moved, as a multiple of x\'s bytes; eval forward launches.', '',
              '| case | setting | ' + ' | '.join(levels) + ' | eval |', '|---|---|' + '---|' * (len(levels) + 1)]
    for row in report['layers']:
        cells = []
        for lv in levels:
            tr = row['levels'].get(lv, {}).get('train')
            cells.append('' if tr is None else f'{tr[0]}+{tr[1]} / {tr[2]:.1f}x')
        ev = sorted({e['eval'][0] + e['eval'][1] for e in row['levels'].values()})
        lines.append(f"| {row['case']} | {row['setting']} | " + ' | '.join(cells) + f" | {'/'.join(map(str, ev))} |")
    changed = sorted({(r['setting'], r['x_layout'], r['y_layout'], r['dx_layout']) for r in report['layers']
                      if r['y_layout'] != r['x_layout'] or r['dx_layout'] != r['x_layout']})
    for setting, x, y, dx in changed:
        lines.append(f'\n{setting}: x {x}, y {y}, dx {dx}: the network converts them back after the layer '
                     f'(not counted above).')
    return '\n'.join(lines) + '\n'
