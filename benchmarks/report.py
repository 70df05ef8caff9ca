"""Render the JSON results in benchmarks/results/ as the markdown tables of docs/performance.md.

    python benchmarks/report.py > /tmp/tables.md

Only formats what the benchmark runs wrote; missing result files are skipped with a note.
"""
import json
import os.path as osp

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
RES = osp.join(ROOT, 'benchmarks', 'results')


def load(name):
    path = osp.join(RES, name)
    if not osp.exists(path):
        print(f'\n_({name} not found: benchmark not run)_\n')
        return None
    with open(path) as f:
        return json.load(f)


def cond_line(c, c_end=None):
    s = (f'{c["date_utc"]} UTC, torch {c["torch"]}, {c["threads"]} thread(s) of {c["cpu_count"]} cores, '
         f'load average at start {c["loadavg_1_5_15"][0]:.1f}')
    if c_end:
        s += f', at end {c_end["loadavg_1_5_15"][0]:.1f}'
    return s + ' (shared machine, other engineers\' jobs running)'


def layers():
    r = load('layers.json')
    if r is None:
        return
    print(f'Conditions: {cond_line(r["conditions"], r.get("conditions_end"))}; {r["channels"]} channels; '
          f'medians of {next(iter(next(iter(r["norm"].values())).values()))["repeats"]} interleaved '
          f'fwd+bwd runs, training mode.\n')
    print('**Norm layers**: time ratio to nn.GroupNorm(32) (median ms of GN in the header), activation memory '
          'ratio to nn.GroupNorm (bytes saved for backward per input element; GN = 4 B = one fp32 copy):\n')
    settings = list(r['norm'])
    names = list(r['norm'][settings[0]])
    print('| layer | ' + ' | '.join(f'{s} time (GN {r["norm"][s]["nn.GroupNorm(32)"]["time_ms"]:.2f} ms)'
                                    for s in settings) + ' | act. memory / GN | fixed MB | ATen ops / step '
          '| page faults / step |')
    print('|---|' + '---|' * (len(settings) + 4))
    for n in names:
        cells = [f'{r["norm"][s][n]["time_ms"] / r["norm"][s]["nn.GroupNorm(32)"]["time_ms"]:.2f}' for s in settings]
        s0 = settings[0]
        mem = r['norm'][s0][n]['act_bytes_per_elem'] / r['norm'][s0]['nn.GroupNorm(32)']['act_bytes_per_elem']
        faults = '/'.join(str(r['norm'][s][n].get('faults_per_step', '?')) for s in settings)
        print(f'| {n} | ' + ' | '.join(cells) + f' | {mem:.2f} | {r["norm"][s0][n]["fixed_bytes"] / 2**20:.2f} | '
              f'{r["norm"][s0][n].get("ops_per_step", "?")} | {faults} |')
    print('\n**3x3 convs 256->256** (post-ReLU input): time ratio to nn.Conv2d (its median ms in the header):\n')
    settings = list(r['conv'])
    names = list(r['conv'][settings[0]])
    print('| layer | ' + ' | '.join(f'{s} (Conv2d {r["conv"][s]["nn.Conv2d"]["time_ms"]:.1f} ms)' for s in settings)
          + ' | act. memory / Conv2d | fixed MB |')
    print('|---|' + '---|' * (len(settings) + 2))
    for n in names:
        cells = [f'{r["conv"][s][n]["time_ms"] / r["conv"][s]["nn.Conv2d"]["time_ms"]:.2f}' for s in settings]
        s0 = settings[0]
        mem = r['conv'][s0][n]['act_bytes_per_elem'] / r['conv'][s0]['nn.Conv2d']['act_bytes_per_elem']
        print(f'| {n} | ' + ' | '.join(cells) + f' | {mem:.2f} | {r["conv"][s0][n]["fixed_bytes"] / 2**20:.2f} |')
    print('\n**Whitening matrix only** (Newton T=5 vs eigh, 4 groups of 64, fwd+bwd, median ms):\n')
    print('| setting | Newton T5 | eigh | eigh / Newton |')
    print('|---|---|---|---|')
    for s, w in r['whitening'].items():
        print(f'| {s} | {w["newton T5"]["time_ms"]:.2f} | {w["zca eigh"]["time_ms"]:.2f} | '
              f'{w["zca eigh"]["time_ms"] / w["newton T5"]["time_ms"]:.2f} |')
    print('\n**Targets** (PASS/FAIL as printed by the run):\n')
    print('| target | settings passed | values |')
    print('|---|---|---|')
    by = {}
    for t in r['targets']:
        by.setdefault(t['target'], []).append(t)
    for name, ts in by.items():
        npass = sum(t['passed'] for t in ts)
        verdict = 'PASS' if npass == len(ts) else ('FAIL' if npass == 0 else 'MIXED')
        vals = ', '.join(f'{t["value"]:.2f}' + (f' ({t["worst"]})' if 'worst' in t else '') for t in ts)
        print(f'| {name} | {verdict} {npass}/{len(ts)} | {vals} |')
    if r.get('fused_vs_reference'):
        print('\n**Fused path (default) vs the reference composition (`fused=False`)**: fwd+bwd time / '
              'nn.GroupNorm(32), time / the elementwise floor (one read + one write of the activation each '
              'way), saved bytes / nn.GroupNorm; reference -> fused:\n')
        print('| layer | setting | time / GN | time / floor | saved / GN | reference / fused time |')
        print('|---|---|---|---|---|---|')
        for row in r['fused_vs_reference']:
            print(f'| {row["layer"]} | {row["setting"]} | {row["reference_time_vs_gn"]:.2f} -> '
                  f'{row["fused_time_vs_gn"]:.2f} | {row["reference_time_vs_floor"]:.2f} -> '
                  f'{row["fused_time_vs_floor"]:.2f} | {row["reference_saved_vs_gn"]:.2f} -> '
                  f'{row["fused_saved_vs_gn"]:.2f} | {row["reference_over_fused_time"]:.2f} |')
    if r.get('recompute'):
        print('\n**`recompute=True`** vs the same layer with plain autograd (default): fwd+bwd time ratio per '
              'setting, activation memory (bytes saved for backward per input element) relative to the '
              'reference, default -> recompute:\n')
        by = {}
        for row in r['recompute']:
            by.setdefault((row['kind'], row['layer']), []).append(row)
        settings = list(dict.fromkeys(row['setting'] for row in r['recompute']))
        print('| layer | ' + ' | '.join(f'{s} time' for s in settings) + ' | memory default | memory recompute '
              '| memory reference |')
        print('|---|' + '---|' * (len(settings) + 3))
        for (_, layer), rows in by.items():
            cells = {row['setting']: f'{row["time_ratio"]:.2f}' for row in rows}
            print(f'| {layer} | ' + ' | '.join(cells.get(s, '') for s in settings) +
                  f' | {rows[0]["mem_default"]:.2f} | {rows[0]["mem_recompute"]:.2f} | {rows[0]["mem_ref"]} |')


def layers_retain():
    r = load('layers_retain.json')
    if r is None:
        return
    print(f'`--malloc retain` (glibc keeps freed memory: no page faults after the warm-up); conditions: '
          f'{cond_line(r["conditions"], r.get("conditions_end"))}. fwd+bwd time / nn.GroupNorm(32) per setting, '
          'fused (reference); median page faults per step of the fused row:\n')
    settings = list(r['norm'])
    print('| layer | ' + ' | '.join(settings) + ' | faults |')
    print('|---|' + '---|' * (len(settings) + 1))
    for n in [n for n in r['norm'][settings[0]] if n + ' reference' in r['norm'][settings[0]]]:
        cells = []
        for st in settings:
            rows = r['norm'][st]
            gn = rows['nn.GroupNorm(32)']['time_ms']
            extra = [f'{rows[k]["time_ms"] / gn:.2f}' for k in (n + ' reference', ) if k in rows]
            cells.append(f'**{rows[n]["time_ms"] / gn:.2f}** ({", ".join(extra)})')
        faults = '/'.join(str(r['norm'][st][n]['faults_per_step']) for st in settings)
        print(f'| {n} | ' + ' | '.join(cells) + f' | {faults} |')


def fuse_latency():
    r = load('fuse_latency.json')
    if r is None:
        return
    print(f'Conditions: {cond_line(r["conditions"], r.get("conditions_end"))}; one {r["image_size"][0]}x'
          f'{r["image_size"][1]} image; {r["repeats"]} interleaved repeats; fuse folded '
          f'{r["fuse_stats"]["folded"]} conv->BCN pairs.\n')
    print('| | median ms | IQR ms |')
    print('|---|---|---|')
    for n, row in r['rows'].items():
        print(f'| {n} | {row["median_ms"]:.1f} | {row["iqr_ms"]:.1f} |')
    print(f'\nSpeed-up (unfused / fused): whole `predict` {r["speedup_predict"]:.2f}x, backbone + FPN '
          f'(`extract_feat`) {r["speedup_extract_feat"]:.2f}x. Max |fused - unfused| / max |unfused| over the FPN '
          f'levels: {r["feature_rel_diff"]:.1e}; same number of detections: {r["same_detection_count"]}, '
          f'max score difference {r["max_score_diff"]}.')


def fused_resnet50():
    r = load('fused_resnet50.json')
    if r is None:
        return
    print(f'Conditions: {cond_line(r["conditions"], r.get("conditions_end"))}; mmdet ResNet-50 backbone, one '
          f'3x{r["image_size"][0]}x{r["image_size"][1]} image, eval, no_grad; {r["repeats"]} interleaved repeats; '
          f'fuse folded {r["fuse_stats"]["folded"]} conv->BCN pairs (each leaves an nn.GroupNorm), '
          f'{r["bn_folded"]} BN folded in the folded baseline.\n')
    print('| model | median ms | IQR ms |')
    print('|---|---|---|')
    for n, row in r['rows'].items():
        print(f'| {n} | {row["median_ms"]:.1f} | {row["iqr_ms"]:.1f} |')
    verdict = 'PASS' if r['passed'] else 'FAIL'
    verdict_folded = 'PASS' if r['passed_vs_folded'] else 'FAIL'
    print(f'\nfused WS+BCN / frozen BN: **{r["ratio_fused_vs_frozen_bn"]:.3f}** ({verdict}, target <= '
          f'{r["target"]}); fused WS+BCN / frozen BN folded into the convs: {r["ratio_fused_vs_frozen_bn_folded"]:.3f} '
          f'({verdict_folded} against the same bound); fused vs unfused WS+BCN: {r["speedup_fused_vs_unfused"]:.2f}x '
          f'faster, outputs agree to {r["fused_rel_diff"]:.1e} of their scale.')


def train_step():
    r = load('train_step.json')
    if r is None:
        return
    print(f'Conditions: {cond_line(r["conditions"], r.get("conditions_end"))}; one {r["image_size"][0]}x'
          f'{r["image_size"][1]} image; {r["repeats"]} interleaved repeats.\n')
    print('| variant | median ms | IQR ms | time / GN | time / mmcv ConvWS+GN | saved for backward MB | '
          'memory / GN |')
    print('|---|---|---|---|---|---|---|')
    for n, row in r['rows'].items():
        print(f'| {n} | {row["median_ms"]:.0f} | {row["iqr_ms"]:.0f} | {row["time_vs_gn"]:.2f} | '
              f'{row["time_vs_mmcv_ws_gn"]:.2f} | {row["saved_MB"]:.1f} | {row["mem_vs_gn"]:.2f} |')


def train_step_r50():
    r = load('train_step_r50.json')
    if r is None:
        return
    print(f'Conditions: {cond_line(r["conditions"], r.get("conditions_end"))}; Mask R-CNN R-50-FPN, one '
          f'{r["image_size"][0]}x{r["image_size"][1]} image; {r["repeats"]} interleaved repeats after one '
          f'warm-up.\n')
    refs = [k[len('time_vs_'):] for k in next(iter(r['rows'].values())) if k.startswith('time_vs_')]
    print('| variant | median ms | IQR ms | ' + ' | '.join(f'time / {k}' for k in refs) + ' |')
    print('|---|---|---|' + '---|' * len(refs))
    for n, row in r['rows'].items():
        print(f'| {n} | {row["median_ms"]:.0f} | {row["iqr_ms"]:.0f} | '
              + ' | '.join(f'{row["time_vs_" + k]:.3f}' for k in refs) + ' |')
    for t in r.get('targets', []):
        print(f'\nTarget: {t["target"]}: {"PASS" if t["passed"] else "FAIL"} ({t["value"]:.3f})')


def digits():
    r = load('microbatch_digits.json')
    if r is None:
        return
    print(f'Conditions: {cond_line(r["conditions"], r.get("conditions_end"))}; {r["epochs"]} epochs; seeds '
          f'{r["seeds"]}. Test accuracy, median [IQR] over seeds:\n')
    keys = list(r['summary'])
    variants = list(dict.fromkeys(k.rsplit(' B', 1)[0] for k in keys))
    batches = list(dict.fromkeys(k.rsplit(' B', 1)[1] for k in keys))
    print('| variant | ' + ' | '.join(f'batch {b}' for b in batches) + ' |')
    print('|---|' + '---|' * len(batches))
    for v in variants:
        cells = []
        for b in batches:
            s = r['summary'][f'{v} B{b}']
            cells.append(f'{s["median"]:.3f} [{s["iqr"]:.3f}]' + (f' ({s["diverged"]} diverged)' if s['diverged']
                                                                  else ''))
        print(f'| {v} | ' + ' | '.join(cells) + ' |')


if __name__ == '__main__':
    for title, fn in (('Layer benchmark', layers), ('Layer benchmark, malloc retained', layers_retain),
                      ('Fused vs unfused inference', fuse_latency),
                      ('Fused WS+BCN ResNet-50 vs frozen-BN ResNet-50', fused_resnet50),
                      ('Training step', train_step), ('Training step, Mask R-CNN R-50-FPN', train_step_r50),
                      ('Micro-batch digits', digits)):
        print(f'\n### {title}\n')
        fn()
