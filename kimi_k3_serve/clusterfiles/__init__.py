"""The renderers of Ray cluster launcher, KubeRay and fake-provider files."""
