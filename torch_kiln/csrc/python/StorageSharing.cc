// Note [Sharing kiln tensors between processes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// CUDA tensors cross torch.multiprocessing queues by IPC handle; kiln ones
// by the runtime's shareable handles (Note [Shareable device memory]): a file
// descriptor for the device allocation holding the storage. The pickling side
// (torch_kiln/kiln/_multiprocessing.py) calls _share_storage, which waits for
// the storage's device (the consumer must see every queued write) and returns
// a descriptor, the allocation's size and the storage's place in it; the
// descriptor travels by multiprocessing's DupFd (SCM_RIGHTS), as CPU tensors'
// shared-memory descriptors do. The receiver calls _import_storage: the
// runtime maps the allocation as device memory of the same device index, and
// the storage's deleter unmaps it. Because the producer's caching allocator
// would otherwise hand the block to its next tensor while a consumer still
// reads it, the producer keeps the storage alive until every consumer has
// released it: each share also sends the write end of a pipe, which the
// consumer's storage holds open (its deleter closes it), and the producer
// drops the storage once the read end reports end-of-file (every write end
// closed — also when the consumer dies). That check runs at each share and in
// torch.kiln.ipc_collect(), like CUDA's CudaIPCSentDataLimbo.
#include "python/StorageSharing.h"

#include <torch/csrc/Storage.h>
#include <unistd.h>

#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>

#include "core/KilnException.h"
#include "core/KilnFunctions.h"

namespace py = pybind11;

namespace torch_kiln {
namespace {

// What an imported storage's deleter releases.
struct ImportedMemory {
  void* base;    // the mapping (kilnFree unmaps it)
  int alive_fd;  // the producer's pipe: closing it tells the producer we are done
};

void releaseImported(void* ctx) {
  auto* memory = static_cast<ImportedMemory*>(ctx);
  KILN_WARN(kilnFree(memory->base));
  if (memory->alive_fd >= 0) {
    close(memory->alive_fd);
  }
  delete memory;
}

} // namespace

void bindStorageSharing(py::module& m) {
  m.def("_share_storage", [](const py::object& storage_object) -> py::tuple {
    // (fd, allocation bytes, storage offset in it, storage bytes, device index)
    TORCH_CHECK(THPStorage_Check(storage_object.ptr()),
                "_share_storage: an UntypedStorage is needed");
    const c10::Storage storage = THPStorage_Unpack(storage_object.ptr());
    TORCH_CHECK(storage.device().is_privateuseone(), "_share_storage: a kiln storage is needed");
    const void* data = storage.data();
    TORCH_CHECK(data != nullptr || storage.nbytes() == 0, "_share_storage: storage has no data");
    {
      py::gil_scoped_release no_gil;
      c10::kiln::device_synchronize(storage.device().index()); // queued writes land first
    }
    if (storage.nbytes() == 0) {
      return py::make_tuple(-1, 0, 0, 0, static_cast<int>(storage.device().index()));
    }
    int fd = -1;
    size_t allocation_size = 0;
    size_t offset = 0;
    KILN_CHECK(kilnMemExportToShareableHandle(&fd, &allocation_size, &offset, data));
    return py::make_tuple(fd, allocation_size, offset, storage.nbytes(),
                          static_cast<int>(storage.device().index()));
  });
  m.def("_import_storage", [](int fd, size_t allocation_size, size_t offset, size_t nbytes,
                              int device, int alive_fd) {
    // A kiln UntypedStorage over the allocation `fd` names (not taking fd);
    // it owns alive_fd and closes it when released.
    c10::kiln::check_device_index(static_cast<c10::DeviceIndex>(device));
    const c10::Device kiln_device(c10::DeviceType::PrivateUse1,
                                  static_cast<c10::DeviceIndex>(device));
    void* base = nullptr;
    if (nbytes > 0) {
      TORCH_CHECK(offset + nbytes <= allocation_size, "_import_storage: the storage (bytes ",
                  offset, " to ", offset + nbytes, ") lies outside its allocation of ",
                  allocation_size, " bytes");
      KILN_CHECK(kilnMemImportFromShareableHandle(&base, fd, allocation_size, device));
    }
    auto* memory = new ImportedMemory{base, alive_fd};
    void* data = base != nullptr ? static_cast<char*>(base) + offset : nullptr;
    c10::DataPtr data_ptr(data, memory, &releaseImported, kiln_device);
    c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data_ptr),
                         /*allocator=*/nullptr, /*resizable=*/false);
    return py::reinterpret_steal<py::object>(THPStorage_Wrap(std::move(storage)));
  });
}

} // namespace torch_kiln
