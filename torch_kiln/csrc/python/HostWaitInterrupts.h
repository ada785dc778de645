// HostWaitInterrupts.h — Ctrl-C while a host thread waits for a kiln device.
// See Note [Ctrl-C during a host wait] in HostWaitInterrupts.cc.
#pragma once

namespace torch_kiln {

// Installs the runtime's host-wait callback and the core layer's interrupt
// thrower. Called once from the _C module's initialisation, on the importing
// thread, which is taken to be the main thread (Python runs signal handlers
// only there). Raises RuntimeError if the runtime refuses the callback.
void installHostWaitInterrupts();

} // namespace torch_kiln
