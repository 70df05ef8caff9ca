"""The sm_90 (H100) hardware report of the StatNorm layers' Triton kernels, built on a machine without a GPU:
every kernel variant a training and an eval step launch at the FPN shapes P2-P7 (2 x 256 channels) and a
classification batch N256 (256 x 256 channels at 7x7; bf16, fp16, fp32, fp64, bf16 autocast, channels_last),
compiled with Triton's launch-time specialization; per variant the width of its activation loads/stores,
registers, spills and fp64 approximations; per step the launches and activation bytes. Writes
<out-dir>/sm90_report.{json,md}. Run without TRITON_INTERPRET.

    python benchmarks/sm90_report.py [--out-dir benchmarks/results] [--settings bf16 fp32 ...] [--levels P2 P7]

The work is tests/kernels/sm90_summary.py (it runs the layers and uses the tests' layer cases and launch
counter: tests/kernels/, not normdense/kernels, which never imports a layer); tests/kernels/
test_sm90_report.py runs this script in CI and fails on the report's violations."""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _json(report):
    """Indented down to one line per variant, step and violation: readable diffs at a reasonable size."""
    parts = []
    for key, value in report.items():
        if isinstance(value, list):
            body = '[\n  ' + ',\n  '.join(json.dumps(v) for v in value) + '\n ]'
        elif key == 'violations':
            body = '{\n' + ',\n'.join(f'  {json.dumps(k)}: [' + ''.join(f'\n   {json.dumps(x)},' for x in v)
                                       .rstrip(',') + ('\n  ]' if v else ']') for k, v in value.items()) + '\n }'
        else:
            body = json.dumps(value)
        parts.append(f' {json.dumps(key)}: {body}')
    return '{\n' + ',\n'.join(parts) + '\n}\n'


def main():
    assert os.environ.get('TRITON_INTERPRET') != '1', 'run without TRITON_INTERPRET: the kernels must be JIT ones'
    from tests.kernels import sm90_record as R
    from tests.kernels import sm90_summary as M
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out-dir', default=os.path.join(ROOT, 'benchmarks', 'results'))
    parser.add_argument('--settings', nargs='+', choices=list(R.DTYPES) + list(R.EXTRA))
    parser.add_argument('--cases', nargs='+')
    parser.add_argument('--levels', nargs='+', choices=list(R.LEVELS))
    parser.add_argument('--arch', type=int, default=90)
    args = parser.parse_args()
    report = M.build(args.settings, args.cases, args.levels, args.arch)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, 'sm90_report.json'), 'w') as f:
        f.write(_json(report))
    with open(os.path.join(args.out_dir, 'sm90_report.md'), 'w') as f:
        f.write(M.markdown(report))
    t = report['timing']
    print(f"{t['steps']} steps recorded in {t['record_s']} s, {t['variants']} variants compiled in {t['compile_s']} s")
    for name, found in report['violations'].items():
        print(f'{name}: {len(found)} violations' + ''.join(f'\n  {v}' for v in found[:5]) +
              (f'\n  ... {len(found) - 5} more' if len(found) > 5 else ''))


if __name__ == '__main__':
    main()
