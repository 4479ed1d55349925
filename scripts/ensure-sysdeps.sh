#!/usr/bin/env bash
# Installs the system packages the test suite and benchmarks use, only when missing:
# Java with its compiler (Spark, and the sbpstream-jvm reader's jar), etcd (PM on etcd), flatc
# (schema regeneration check), redis and nats (benchmark peers), chromium and chromium-driver
# (the web console's browser test, Selenium).
# `ensure-sysdeps.sh jdk` installs only the JDK (what `make install` needs to build the jar).
set -euo pipefail
need=()
# default-jdk-headless holds javac and the java runtime
command -v javac >/dev/null 2>&1 || need+=(default-jdk-headless)
if [ "${1:-}" != jdk ]; then
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v flatc >/dev/null 2>&1 || need+=(flatbuffers-compiler)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v nats-server >/dev/null 2>&1 || need+=(nats-server)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
fi
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
echo "installing system packages: ${need[*]}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
