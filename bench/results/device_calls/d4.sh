#!/usr/bin/env bash
# Fourth call: the hardened shared-memory path on the H200 host: its tests (C++ and the Python
# client against grpcio 1.84), then the floor (TCP / Unix / shm) and the empty round trips alone.
set -u
tar -C .device/lead -xJf .device/lead/ship/bundle.tar.xz
mkdir -p .device/hop && ln -sfn ../lead/bundle .device/hop/bundle
export LD_LIBRARY_PATH=$PWD/.device/lead/bundle/lib
.device/lead/bundle/bin/service_shared_memory_test --gtest_brief=1 2>&1 | tail -n 3
[ -d client/python/kvrecall/_gen ] || cp -r .device/lead/bundle/python/_gen client/python/kvrecall/_gen
(cd tests && KVRECALLD=$PWD/../.device/lead/bundle/bin/kvrecalld PYTHONPATH=$PWD/../client/python \
  timeout 120 python3 -m unittest python_client_test.SharedMemoryTest python_client_test.SharedRegionLayoutTest 2>&1 | tail -n 4)
BUDGET_S=230 FLOOR_S=200 ITERATIONS=3000 PY_ITERATIONS=1000 SERVERS="echo-sync echo-callback kvrecalld" \
  CLIENTS="c++ python-numpy" bash bench/echo_floor_device.sh floor alone 2>&1 | tail -n 34
cd "$OUT" && tar czf /tmp/d4_out.tgz . && find . -mindepth 1 -maxdepth 1 ! -name '*.md' -exec rm -rf {} + ; mv /tmp/d4_out.tgz "$OUT/d4_out.tgz"
