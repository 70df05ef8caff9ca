"""A tool script of tools/ loaded as a module, so a test calls its main() in-process."""
import importlib.util
import os.path as osp

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f'{name}_tool', osp.join(ROOT, 'tools', f'{name}.py'))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool
