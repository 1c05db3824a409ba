"""The end-to-end demo: the README's main job on a self-built sample corpus."""
