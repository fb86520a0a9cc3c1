from pathlib import Path

from setuptools import find_packages, setup


def _requirements():
    lines = Path(__file__).with_name("requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="lightllm",
    version="0.1.0",
    description="LLM inference server with a phase-aware kernel autotuner",
    packages=find_packages(include=["lightllm", "lightllm.*"]),
    package_data={"lightllm.common.autotuner": ["configs/**/*.json"], "lightllm.layers": ["fla_configs/**/*.json"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=_requirements(),
    # numpy<2.4: Triton 3.6's interpreter turns 1-element arrays into scalars, which numpy 2.4 refuses.
    # openai and langchain-openai: the real clients tests/server/test_openai_clients.py drives the server with.
    extras_require={
        "test": [
            "pytest>=8",
            "black>=24",
            "flake8>=7",
            "numpy<2.4",
            "httpx>=0.27",
            "openai==3.57.0",
            "langchain-openai==1.7.4",
        ]
    },
)
