"""tests/durations.json from a run's JUnit XML (``make test PYTEST_ARGS="--junitxml=/tmp/t.xml"``): the tests over
1 s, {node id: seconds of setup + call + teardown}; tests/conftest.py leaves those over its FAST_LIMIT out of
``make test-fast``. Usage: python tests/durations.py /tmp/t.xml > tests/durations.json"""
import json
import os.path as osp
import sys
import xml.etree.ElementTree as ET

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def node_id(classname, name):
    """'tests.kernels.test_x[.TestClass]' and the test's name -> 'tests/kernels/test_x.py[::TestClass]::name'."""
    parts = classname.split('.')
    for i in range(len(parts), 0, -1):
        path = '/'.join(parts[:i]) + '.py'
        if osp.isfile(osp.join(ROOT, path)):
            return '::'.join([path, *parts[i:], name])
    raise ValueError(f'no test file for {classname}')


def main(xml_path, minimum=1.0):
    times = {}
    for case in ET.parse(xml_path).getroot().iter('testcase'):
        seconds = float(case.get('time'))
        if seconds >= minimum:
            times[node_id(case.get('classname'), case.get('name'))] = round(seconds, 1)
    json.dump(dict(sorted(times.items())), sys.stdout, indent=0)
    sys.stdout.write('\n')


if __name__ == '__main__':
    main(sys.argv[1])
