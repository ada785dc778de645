// TerminateReport.h — a readable report when std::terminate ends the process.
// See Note [Reporting std::terminate] in TerminateReport.cc.
#pragma once

namespace torch_kiln {

// Installs the report as the process's std::terminate handler, chaining to
// the handler that was installed before (libstdc++'s verbose handler, which
// prints the active exception and aborts). Called once from the _C module's
// initialisation; idempotent.
void installTerminateReport();

} // namespace torch_kiln
