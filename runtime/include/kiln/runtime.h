/*
 * kiln/runtime.h — the public C API of libkilnrt, Kiln's device runtime.
 *
 * This is the only interface the PyTorch layer (torch_kiln/csrc) uses to reach
 * a device. It reads like CUDA's runtime API with a `kiln` prefix so that an
 * accelerator engineer recognises every call; a real chip's runtime can
 * replace the reference implementation behind it without touching PyTorch.
 *
 * The reference device (runtime/src) is a software-defined accelerator on the
 * host CPU with the semantics of real hardware:
 *   - devices:  KILN_DEVICE_COUNT logical devices (default 2), numbered 0..n-1,
 *               of which KILN_VISIBLE_DEVICES may select and renumber some;
 *   - memory:   host RAM owned by the runtime, with a per-device capacity
 *               (KILN_DEVICE_MEMORY, default 16GiB); an allocation past the
 *               capacity fails with kilnErrorMemoryAllocation, never crashes;
 *   - streams:  in-order task queues, each run by its own worker thread; every
 *               device has a default stream;
 *   - events:   markers on streams: record, wait, query, synchronize, timing;
 *   - tasks:    the unit of device work. On the reference device a task is a
 *               host function run by the stream's worker thread; it may read
 *               and write device memory directly (device pointers are host
 *               addresses there);
 *   - tracing:  while activity tracing is on, every unit of device work and
 *               the call that enqueued it leave a timed record for a
 *               profiler (see "Activity tracing" below);
 *   - errors:   every call returns a status code; a failing task leaves a
 *               sticky error on its stream that the next synchronization or
 *               query of that stream returns, with the task's name and message.
 *               KILN_LAUNCH_BLOCKING=1 runs every task on the calling thread at
 *               launch, so a failing task fails its own launch call.
 *
 * Conventions
 *   - All functions are thread-safe. No function throws (C linkage).
 *   - Sizes and counts are in bytes. Times are in milliseconds, except the
 *     activity records of the tracing API, which are in nanoseconds.
 *   - A NULL kilnStream_t means the default stream of the calling thread's
 *     current device, resolved at call time.
 *   - When a call fails, kilnGetLastErrorMessage() gives a sentence naming what
 *     was asked and what is allowed (e.g. the requested size and the free and
 *     total memory for an out-of-memory error). kilnErrorNotReady from a query
 *     (kilnStreamQuery, kilnEventQuery) is an answer, not a failure, and leaves
 *     the message alone.
 *   - The runtime initialises itself on first use. A process forked after the
 *     runtime was initialised cannot use it: every call in the child returns
 *     kilnErrorInitializationError (use the 'spawn' start method instead).
 */
#ifndef KILN_RUNTIME_H_
#define KILN_RUNTIME_H_

#include <stddef.h>

#if defined(_WIN32)
#define KILN_API __declspec(dllexport)
#else
#define KILN_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* 2: activity tracing (kilnActivity*) and kilnStreamGetId.
 * 3: bounded launch queues (KILN_LAUNCH_QUEUE_DEPTH), kilnSetHostWaitCallback,
 *    kilnRuntimeShutdown, kilnErrorRuntimeUnloading, kilnErrorInterrupted,
 *    kilnMemExportToShareableHandle, kilnMemImportFromShareableHandle, error
 *    classes of failed tasks (kilnTaskSetErrorClass, kilnGetLastErrorClass). */
/* 4: stream capture and graphs (kilnStreamBeginCapture, kilnStreamEndCapture,
 *    kilnStreamIsCapturing, kilnGraphLaunch, kilnGraphDestroy,
 *    kilnGraphGetNodeCount), kilnErrorIllegalState and the capture errors.
 * 5: kilnStreamGetSubmittedCount and kilnTaskSetActivityName (adaptive eager
 *    fusion).
 * 6: cross-stream capture (other streams join a capture through events),
 *    kilnStreamGetCaptureInfo, and the capture errors 902, 903, 904, 906, 907. */
#define KILN_RUNTIME_VERSION 6

/* ------------------------------------------------------------------------ */
/* Errors                                                                    */
/* ------------------------------------------------------------------------ */

/* Status codes. The numbers follow CUDA's cudaError_t where one exists. */
typedef enum kilnError {
  kilnSuccess = 0,
  kilnErrorInvalidValue = 1,          /* an argument is out of range or NULL   */
  kilnErrorMemoryAllocation = 2,      /* out of device (or host) memory        */
  kilnErrorInitializationError = 3,   /* bad environment, or a forked child    */
  kilnErrorRuntimeUnloading = 4,      /* the process is exiting: work refused
                                         (kilnRuntimeShutdown)                 */
  kilnErrorInvalidDevicePointer = 17, /* not a live pointer from kilnMalloc    */
  kilnErrorInvalidDevice = 101,       /* device index outside [0, count)       */
  kilnErrorInvalidResourceHandle = 400, /* bad stream or event handle, or an
                                           event that cannot be timed          */
  kilnErrorNotReady = 600,            /* work is still pending (query calls)   */
  kilnErrorLaunchFailure = 719,       /* a task failed (sticky on its stream)  */
  kilnErrorIllegalState = 401,        /* e.g. ending a capture never begun     */
  kilnErrorNotPermitted = 800,        /* operation not allowed in this state   */
  kilnErrorStreamCaptureUnsupported = 900, /* operation not permitted when stream
                                              is capturing (the capture is then
                                              invalidated)                    */
  kilnErrorStreamCaptureInvalidated = 901, /* the capture was invalidated by an
                                              earlier refused operation        */
  kilnErrorStreamCaptureMerge = 902,  /* a wait would merge two captures       */
  kilnErrorStreamCaptureUnmatched = 903, /* a capture ended on a stream that
                                            only joined it                     */
  kilnErrorStreamCaptureUnjoined = 904, /* a capture ended while a stream that
                                           joined it has work the origin does
                                           not wait for                       */
  kilnErrorStreamCaptureImplicit = 906, /* the default stream would join a
                                           capture                            */
  kilnErrorCapturedEvent = 907,       /* query, synchronize or time an event
                                         whose latest record was captured      */
  kilnErrorInterrupted = 990,         /* a host wait was abandoned because the
                                         host-wait callback asked to stop (no
                                         CUDA equivalent)                      */
  kilnErrorUnknown = 999
} kilnError_t;

/* The enumerator's name, e.g. "kilnErrorMemoryAllocation". Never NULL. */
KILN_API const char* kilnGetErrorName(kilnError_t error);

/* A short description of the code, e.g. "out of memory". Never NULL. */
KILN_API const char* kilnGetErrorString(kilnError_t error);

/* The detailed message of the last failing call made by this thread (empty
 * string if none). The pointer stays valid until this thread's next failing
 * call. Example: "kilnMalloc: out of memory on kiln device 0: requested
 * 1125899906842624 bytes (1.00 PiB); 17179869184 bytes (16.00 GiB) free of
 * 17179869184 bytes (16.00 GiB) total". */
KILN_API const char* kilnGetLastErrorMessage(void);

/* The error class of this thread's last failing call: for a failure of a task
 * (kilnErrorLaunchFailure, returned by the synchronization that reports a
 * sticky error or, with KILN_LAUNCH_BLOCKING=1, by the launch), the class the
 * task set with kilnTaskSetErrorClass; 0 otherwise, and for tasks that set
 * none. Replaced together with the message. */
KILN_API int kilnGetLastErrorClass(void);

/* Version of this runtime (KILN_RUNTIME_VERSION). Answers even when the
 * environment is invalid (it needs no device). */
KILN_API kilnError_t kilnRuntimeGetVersion(int* version);

/* ------------------------------------------------------------------------ */
/* Devices                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct kilnDeviceProp {
  char name[256];             /* "Kiln reference device"                    */
  size_t totalGlobalMem;      /* capacity in bytes (KILN_DEVICE_MEMORY)      */
  int multiProcessorCount;    /* host cores the device's kernels may use     */
  int streamPriorityLowest;   /* 0                                           */
  int streamPriorityHighest;  /* -1 (lower number = higher priority, as CUDA) */
  int pciBusID;               /* the device's index among the KILN_DEVICE_COUNT
                                 devices, whatever KILN_VISIBLE_DEVICES numbers
                                 it (CUDA's pciBusID names the board)        */
} kilnDeviceProp;

/* Number of devices this process sees: KILN_DEVICE_COUNT (default 2, allowed
 * 0..64), or as many of them as KILN_VISIBLE_DEVICES selects, numbered 0..n-1
 * in its order (CUDA_VISIBLE_DEVICES's rules: an empty value selects none, the
 * list ends at an entry that is not a non-negative number or is out of range,
 * a repeated index selects none).
 * Fails with kilnErrorInitializationError if the environment is invalid. */
KILN_API kilnError_t kilnGetDeviceCount(int* count);

/* The calling thread's current device (default 0). With no devices
 * (KILN_DEVICE_COUNT=0) it fails with kilnErrorInvalidDevice. */
KILN_API kilnError_t kilnGetDevice(int* device);
KILN_API kilnError_t kilnSetDevice(int device); /* kilnErrorInvalidDevice */

KILN_API kilnError_t kilnGetDeviceProperties(kilnDeviceProp* prop, int device);

/* Blocks until every stream of the current device has finished its work.
 * Returns (and clears) the first sticky error found among those streams. */
KILN_API kilnError_t kilnDeviceSynchronize(void);

/* Free and total bytes of the current device's memory. */
KILN_API kilnError_t kilnMemGetInfo(size_t* free_bytes, size_t* total_bytes);

/* Priority range for kilnStreamCreateWithPriority: *least = 0,
 * *greatest = -1, as CUDA reports it. */
KILN_API kilnError_t kilnDeviceGetStreamPriorityRange(int* least, int* greatest);

/* ------------------------------------------------------------------------ */
/* Memory                                                                    */
/* ------------------------------------------------------------------------ */

/* Allocates `size` bytes of device memory on the current device, aligned to
 * 256 bytes. size 0 succeeds with *devPtr = NULL. Past the device's capacity:
 * kilnErrorMemoryAllocation (message: requested, free, total); the same code
 * if the host cannot provide the memory. Capacity is charged in 256-byte
 * units (kilnMemGetInfo reports what is left). The memory is not
 * initialised. */
KILN_API kilnError_t kilnMalloc(void** devPtr, size_t size);

/* Frees memory from kilnMalloc. NULL is a no-op. Like cudaFree it first waits
 * for the work already launched — on every device, since a peer copy or a
 * task on another device's stream may use this memory — so no pending task
 * can touch freed memory (sticky errors are left to the streams). A pointer
 * that is not live (freed twice, interior, or never from kilnMalloc) fails
 * with kilnErrorInvalidDevicePointer and changes nothing. */
KILN_API kilnError_t kilnFree(void* devPtr);

/* Page-locked ("pinned") host memory: host memory the device can copy to and
 * from asynchronously. Not counted against device capacity. size 0 gives
 * NULL. kilnFreeHost waits for the work already launched on every device (an
 * asynchronous copy may still use the memory) and rejects pointers not from
 * kilnMallocHost with kilnErrorInvalidValue. */
/* Sharing device memory between processes, as CUDA's POSIX-file-descriptor
 * shareable handles (cuMemExportToShareableHandle /
 * cuMemImportFromShareableHandle with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR).
 *
 * kilnMemExportToShareableHandle: *fd receives a new file descriptor (the
 * caller owns it and closes it) naming the whole allocation that contains
 * devPtr; *allocationSize its size in bytes and *offset devPtr's offset in it.
 * Send the descriptor to another process over a Unix socket (SCM_RIGHTS).
 * kilnErrorInvalidDevicePointer if devPtr is not device memory.
 *
 * kilnMemImportFromShareableHandle: maps the allocation named by `fd` (of
 * `allocationSize` bytes, as exported) as device memory of `device` in this
 * process; *devPtr is its base. The caller keeps ownership of fd. The memory
 * is the exporter's: writes on either side are seen by the other once the
 * writer's stream work has completed, and it is not charged to `device`'s
 * capacity. kilnFree(*devPtr) unmaps it. The pages stay valid while any
 * process maps them, also after the exporter frees its allocation. */
KILN_API kilnError_t kilnMemExportToShareableHandle(int* fd, size_t* allocationSize,
                                                   size_t* offset, const void* devPtr);
KILN_API kilnError_t kilnMemImportFromShareableHandle(void** devPtr, int fd,
                                                     size_t allocationSize, int device);

KILN_API kilnError_t kilnMallocHost(void** ptr, size_t size);
KILN_API kilnError_t kilnFreeHost(void* ptr);

typedef enum kilnMemoryType {
  kilnMemoryTypeUnregistered = 0, /* ordinary (pageable) host memory */
  kilnMemoryTypeHost = 1,         /* from kilnMallocHost             */
  kilnMemoryTypeDevice = 2        /* from kilnMalloc                 */
} kilnMemoryType;

typedef struct kilnPointerAttributes {
  kilnMemoryType type;
  int device;          /* owning device for device memory, else -1          */
  void* basePointer;   /* start of the allocation containing the pointer    */
  size_t allocationSize; /* size of that allocation in bytes (0 if unknown) */
} kilnPointerAttributes;

/* Describes any pointer, including interior pointers of an allocation. An
 * unknown pointer succeeds with type kilnMemoryTypeUnregistered (as CUDA 11+). */
KILN_API kilnError_t kilnPointerGetAttributes(kilnPointerAttributes* attributes,
                                             const void* ptr);

/* ------------------------------------------------------------------------ */
/* Streams, tasks and events                                                 */
/* ------------------------------------------------------------------------ */

typedef struct kilnStream_st* kilnStream_t;
typedef struct kilnEvent_st* kilnEvent_t;

/* The default stream of `device`. It exists for the life of the process and
 * cannot be destroyed. */
KILN_API kilnError_t kilnStreamGetDefault(kilnStream_t* stream, int device);

/* Creates a stream on the current device. Priority is clamped to the range of
 * kilnDeviceGetStreamPriorityRange. flags must be 0. */
KILN_API kilnError_t kilnStreamCreate(kilnStream_t* stream);
KILN_API kilnError_t kilnStreamCreateWithPriority(kilnStream_t* stream,
                                                 unsigned int flags,
                                                 int priority);

/* Waits for the stream's pending work, then destroys it. Destroying a default
 * stream fails with kilnErrorInvalidResourceHandle. If the stream holds a
 * sticky error nobody has synchronised on, it is returned here (once) and the
 * stream is destroyed anyway. */
KILN_API kilnError_t kilnStreamDestroy(kilnStream_t stream);

/* kilnSuccess when all work launched so far has finished, kilnErrorNotReady
 * while some is pending, or the stream's sticky error (which is then cleared,
 * so the stream works again). */
KILN_API kilnError_t kilnStreamQuery(kilnStream_t stream);

/* Blocks until all work launched on the stream before this call has finished.
 * Returns and clears the stream's sticky error, if any. */
KILN_API kilnError_t kilnStreamSynchronize(kilnStream_t stream);

/* Makes all work launched on `stream` after this call wait until the work
 * captured by the most recent kilnEventRecord of `event` has finished. An
 * event never recorded is already complete. flags must be 0. Works across
 * devices. */
KILN_API kilnError_t kilnStreamWaitEvent(kilnStream_t stream, kilnEvent_t event,
                                        unsigned int flags);

KILN_API kilnError_t kilnStreamGetDevice(kilnStream_t stream, int* device);
KILN_API kilnError_t kilnStreamGetPriority(kilnStream_t stream, int* priority);

/* A number naming the stream in activity records (kilnActivityRecord.streamId):
 * unique among the streams of the process, never 0, and never reused, also not
 * when a destroyed stream's handle is reused by kilnStreamCreate (CUDA's
 * cudaStreamGetId). */
KILN_API kilnError_t kilnStreamGetId(kilnStream_t stream, unsigned long long* streamId);

/* How many entries have ever been enqueued on `stream`: tasks, copies,
 * memsets, event records, event waits and graph launches, from any thread
 * (work recorded by a stream capture is not enqueued and not counted). It
 * only grows. A client that reads it just before and just after its own
 * kilnLaunchTask and sees it grow by exactly one knows the count its entry
 * got; a later read equal to that count means nothing was enqueued on the
 * stream after that entry (the check adaptive eager fusion makes, Note
 * [Adaptive eager fusion] in torch_kiln). One atomic load. */
KILN_API kilnError_t kilnStreamGetSubmittedCount(kilnStream_t stream,
                                                 unsigned long long* count);

/* A task: device work. Returns kilnSuccess, or an error code after describing
 * the failure with kilnTaskSetErrorMessage(). */
typedef kilnError_t (*kilnTaskFn_t)(void* userData);
/* Releases a task's userData. Called exactly once per launch attempt. */
typedef void (*kilnTaskReleaseFn_t)(void* userData);

/* Enqueues `fn(userData)` on `stream`; it runs after all work launched on the
 * stream before it. `name` (may be NULL) names the task in error messages and
 * must stay valid until `release` has been called.
 *
 * If fn fails, the stream records a sticky error
 * (kilnErrorLaunchFailure, message "<name>: <task message>"); tasks launched
 * later on that stream are skipped until the error has been returned by
 * kilnStreamSynchronize, kilnStreamQuery or kilnDeviceSynchronize. Event
 * records and waits still take effect on a stream in error, so other streams
 * never wait forever.
 *
 * `release(userData)` (if not NULL) is called exactly once, after fn has run
 * or been skipped, on whichever thread ran or skipped it. If this call returns
 * an error, the task was not enqueued (or, with KILN_LAUNCH_BLOCKING=1, it ran
 * and failed) and release has already been called.
 *
 * Inside fn (and release) the task may launch work, record events and query,
 * but a call that would wait for the task's own stream — kilnStreamSynchronize
 * or kilnStreamDestroy of it, kilnDeviceSynchronize of its device, kilnFree,
 * kilnFreeHost, a synchronous copy on it, kilnEventSynchronize of a record
 * queued behind it — fails with kilnErrorNotPermitted instead of deadlocking.
 * A C++ exception escaping fn counts as a failure with the exception's
 * message; it does not cross the runtime. */
KILN_API kilnError_t kilnLaunchTask(kilnStream_t stream, kilnTaskFn_t fn,
                                   kilnTaskReleaseFn_t release, void* userData,
                                   const char* name);

/* Called by a running task to describe its failure before returning an error
 * code. The text is copied. Outside a task it does nothing. */
KILN_API void kilnTaskSetErrorMessage(const char* message);

/* Called by a running task to name itself in its activity record (the
 * profiler's kernel name) instead of the launch's `name`, for a task whose
 * content was only settled after its launch. The text is copied (truncated to
 * KILN_ACTIVITY_NAME_MAX - 1 bytes). Error messages keep the launch's name.
 * Outside a task, or while tracing is off, it does nothing. */
KILN_API void kilnTaskSetActivityName(const char* name);

/* Called by a running task, before returning an error code, to classify its
 * failure with a number of the client's choosing (0, the default, means
 * unclassified). The runtime keeps it with the task's message — in the sticky
 * error, or in the failing launch with KILN_LAUNCH_BLOCKING=1 — and the call
 * that reports the failure makes it the calling thread's
 * kilnGetLastErrorClass(). The runtime gives the number no meaning: a client
 * uses it to report a failed task's error as the kind it was (the PyTorch
 * layer re-raises a kernel's IndexError as an IndexError at
 * synchronization). Outside a task it does nothing. */
KILN_API void kilnTaskSetErrorClass(int errorClass);

/* 1 if tasks run on the calling thread at launch (KILN_LAUNCH_BLOCKING=1),
 * else 0. */
KILN_API kilnError_t kilnGetLaunchBlocking(int* blocking);

/* ------------------------------------------------------------------------ */
/* The launch queue, host waits and shutdown                                 */
/* ------------------------------------------------------------------------ */

/*
 * Launch queue. Each stream holds at most KILN_LAUNCH_QUEUE_DEPTH entries
 * that have not started (default 1024, the order of CUDA's pending-launch
 * limit). A host thread that launches work — kilnLaunchTask, kilnMemcpy*,
 * kilnMemsetAsync — onto a full stream waits until the stream starts an
 * entry, so a program that runs far ahead of a slow or stalled device holds
 * bounded memory. Event records and waits never wait for room, nor does work
 * launched from inside a task (a worker must never block on a queue, or two
 * streams could wait for each other); both may exceed the depth.
 *
 * Host waits: kilnStreamSynchronize, kilnDeviceSynchronize,
 * kilnEventSynchronize, a synchronous copy waiting for the work queued before
 * it, and a launch waiting for room in the queue.
 */

/* Called on a host thread that has been blocked in a host wait for
 * `intervalMs`, and again every `intervalMs` while the wait lasts (not while
 * the wait is only spinning, and never on a worker thread). Return 0 to keep
 * waiting; anything else abandons the wait: the call returns
 * kilnErrorInterrupted and the device work goes on (a launch that was
 * waiting for room was not enqueued). A synchronous copy is only abandoned
 * before it is enqueued, never half done. Lets a host runtime deliver a
 * signal (Ctrl-C) to a thread waiting for the device: PyTorch's layer checks
 * Python's signal handlers here. NULL removes the callback; intervalMs must
 * be 1..60000. Needs no device: it does not initialise the runtime. */
typedef int (*kilnHostWaitCallback_t)(void* userData);
KILN_API kilnError_t kilnSetHostWaitCallback(kilnHostWaitCallback_t callback,
                                            void* userData,
                                            unsigned int intervalMs);

/* For process exit: stops accepting device work (every later kilnLaunchTask,
 * kilnMemcpy* and kilnMemsetAsync fails with kilnErrorRuntimeUnloading,
 * including launches waiting for room in a queue), lets the queues run for
 * up to `drainMs`, then drops every queued task, copy and memset that has not
 * started (release functions still run, once), and waits up to `timeoutMs`
 * more for the entries that are running to end.
 * *dropped (may be NULL) receives the number of entries dropped, counting
 * those still queued behind a task running at the timeout. Event
 * records and waits still take effect. Returns kilnErrorNotReady if some
 * entry was still running at the timeout. Irreversible; calling it again
 * waits again. Fails with kilnErrorNotPermitted from inside a task. */
KILN_API kilnError_t kilnRuntimeShutdown(unsigned int drainMs, unsigned int timeoutMs,
                                        unsigned long long* dropped);

enum {
  kilnEventDefault = 0x0,
  kilnEventBlockingSync = 0x1, /* accepted; the reference device always blocks */
  kilnEventDisableTiming = 0x2
};

KILN_API kilnError_t kilnEventCreate(kilnEvent_t* event);
KILN_API kilnError_t kilnEventCreateWithFlags(kilnEvent_t* event,
                                             unsigned int flags);

/* Destroys an event. Safe while a record of it is still pending; streams
 * already waiting on it are released when that record completes. */
KILN_API kilnError_t kilnEventDestroy(kilnEvent_t event);

/* Captures the work launched on `stream` so far. When that work has finished
 * the event completes and takes the device's clock as its timestamp. A later
 * record replaces the earlier one. */
KILN_API kilnError_t kilnEventRecord(kilnEvent_t event, kilnStream_t stream);

/* kilnSuccess if the most recent record has completed (or the event was never
 * recorded), kilnErrorNotReady otherwise. If a task before the record failed,
 * its stream's sticky error is returned instead (and cleared, as by
 * kilnStreamSynchronize): the work the event stands for did not all run. */
KILN_API kilnError_t kilnEventQuery(kilnEvent_t event);

/* Blocks until the most recent record has completed. Returns the sticky error
 * of the record's stream, as kilnEventQuery does. */
KILN_API kilnError_t kilnEventSynchronize(kilnEvent_t event);

/* Milliseconds between the completions of `start` and `end` (may be negative
 * if end completed first). Both must have been recorded with timing enabled:
 * otherwise kilnErrorInvalidResourceHandle; kilnErrorNotReady if either record
 * is still pending. */
KILN_API kilnError_t kilnEventElapsedTime(float* ms, kilnEvent_t start,
                                         kilnEvent_t end);

/* ------------------------------------------------------------------------ */
/* Stream capture and graphs                                                 */
/* ------------------------------------------------------------------------ */

/*
 * CUDA Graphs' capture model (cudaStreamBeginCapture / cudaGraphLaunch) for
 * kiln streams. Between kilnStreamBeginCapture and kilnStreamEndCapture, the
 * work launched on the capturing stream — tasks (kilnLaunchTask), device
 * copies and copies to or from pinned host memory (kilnMemcpyAsync,
 * kilnMemcpyPeerAsync), memsets — is recorded into a graph instead of being
 * run: the calls return kilnSuccess and nothing executes. kilnGraphLaunch
 * then enqueues the whole graph on a stream as ONE queue entry that runs the
 * recorded work in capture order, as many times as it is launched.
 *
 * Other streams join a capture as in CUDA (fork and join through events):
 *   - kilnEventRecord on a capturing stream records nothing to run; it marks
 *     the event with the capture and the position of that stream's work.
 *   - kilnStreamWaitEvent(other, event) on such an event makes `other` (a
 *     stream of the same device, not its default stream) join the capture:
 *     from then on its launches are recorded into the same graph, ordered
 *     after the work the event marks. A stream of the capture waiting for
 *     another member's event only adds that ordering.
 *   - Before kilnStreamEndCapture of the stream that began the capture (the
 *     origin), every joined stream must be joined back: the origin waits for
 *     an event recorded on it after its last captured work. Otherwise the
 *     capture fails with kilnErrorStreamCaptureUnjoined. Ending the capture
 *     ends it for every joined stream; kilnStreamEndCapture on a joined
 *     stream fails with kilnErrorStreamCaptureUnmatched (and invalidates the
 *     capture).
 * A graph's nodes from all its streams run in the order they were captured,
 * one after another, on the stream the graph is launched on: an order that
 * keeps every dependency the events expressed (each was captured before the
 * work that waits for it), without the concurrency of the side streams.
 *
 * A captured task's fn runs once per launch of its graph (with the same
 * userData), so fn must not consume userData; its release runs once, when
 * the graph is destroyed and its last launch has finished.
 *
 * Operations that would wait for a capturing stream (the origin or one that
 * joined), or that the model cannot record, fail with
 * kilnErrorStreamCaptureUnsupported ("operation not permitted when stream is
 * capturing") and invalidate the capture (CUDA's
 * cudaErrorStreamCaptureUnsupported / Invalidated):
 *   - kilnStreamSynchronize or kilnStreamQuery of a capturing stream,
 *     kilnDeviceSynchronize of its device, kilnStreamDestroy of it;
 *   - a synchronous copy on it (into pageable host memory, or kilnMemcpy),
 *     and an asynchronous copy from pageable host memory (it would be staged
 *     once, at capture, where CUDA reads the host memory at each launch);
 *   - kilnStreamWaitEvent on it for a record made outside any capture that
 *     has not completed (a graph cannot wait for uncaptured work). Waiting
 *     for a record that has already completed is a no-op and allowed;
 *   - kilnGraphLaunch onto it (no child graphs).
 * Cross-stream errors, each of which also invalidates the capture involved:
 *   - kilnErrorStreamCaptureImplicit: the default stream would join (it
 *     cannot capture, as CUDA's legacy stream); kilnErrorInvalidValue: a
 *     stream of another device would join;
 *   - kilnErrorStreamCaptureMerge: a stream of one capture waits for an
 *     event recorded in another;
 *   - kilnErrorCapturedEvent: kilnEventQuery, kilnEventSynchronize or
 *     kilnEventElapsedTime of an event whose latest record was captured,
 *     and kilnStreamWaitEvent for it once its capture has ended.
 * After an invalidation every launch onto a stream of the capture fails with
 * kilnErrorStreamCaptureInvalidated (release is called, as for any failed
 * launch) until kilnStreamEndCapture, which returns that code and no graph.
 * Streams outside the capture, also of the same device, keep working normally.
 *
 * A failing task inside a launched graph fails the graph's entry as a
 * failing task fails its own: the stream's sticky error names the task
 * ("<task name>: <message>"), and the rest of the graph is not run.
 * Activity tracing records one kilnActivityKindTask record per launch,
 * named "kiln graph (<n> nodes)".
 */
typedef struct kilnGraph_st* kilnGraph_t;

typedef enum kilnStreamCaptureStatus {
  kilnStreamCaptureStatusNone = 0,        /* not capturing              */
  kilnStreamCaptureStatusActive = 1,      /* capturing                  */
  kilnStreamCaptureStatusInvalidated = 2  /* capturing, but invalidated */
} kilnStreamCaptureStatus;

/* Starts capturing `stream`. flags must be 0. The default stream cannot
 * capture (kilnErrorStreamCaptureUnsupported, as CUDA's legacy stream);
 * a stream already capturing fails with kilnErrorIllegalState. */
KILN_API kilnError_t kilnStreamBeginCapture(kilnStream_t stream, unsigned int flags);

/* Ends the capture of `stream`: *graph receives the recorded graph (the
 * caller owns it; kilnGraphDestroy). kilnErrorIllegalState if the stream is
 * not capturing; kilnErrorStreamCaptureInvalidated (with the message of the
 * operation that invalidated it) if it was invalidated: the capture ends and
 * *graph is NULL. */
KILN_API kilnError_t kilnStreamEndCapture(kilnStream_t stream, kilnGraph_t* graph);

/* The capture status of `stream` (a stream that joined a capture is
 * capturing too). Does not synchronize. */
KILN_API kilnError_t kilnStreamIsCapturing(kilnStream_t stream, kilnStreamCaptureStatus* status);

/* The capture status of `stream` and, when it is capturing, the capture's id
 * (*id, if id is not NULL): the same for the origin and every stream that
 * joined it, unique in the process, never 0 (0 when not capturing). As
 * cudaStreamGetCaptureInfo. Does not synchronize. */
KILN_API kilnError_t kilnStreamGetCaptureInfo(kilnStream_t stream, kilnStreamCaptureStatus* status,
                                              unsigned long long* id);

/* Enqueues one run of `graph` on `stream` (ordered after the work launched
 * there before, like any launch): one entry in the launch queue whatever the
 * number of nodes. The stream must belong to the device the graph was
 * captured on (kilnErrorInvalidValue otherwise). An empty graph launches as
 * a no-op entry. */
KILN_API kilnError_t kilnGraphLaunch(kilnGraph_t graph, kilnStream_t stream);

/* Destroys `graph`. Launches still queued or running finish first; the
 * captured tasks' release functions run after the last one (on the thread
 * that drops the last reference: this one, or a stream worker). NULL is a
 * no-op. */
KILN_API kilnError_t kilnGraphDestroy(kilnGraph_t graph);

/* Number of recorded nodes (tasks, copies, memsets) of `graph`. */
KILN_API kilnError_t kilnGraphGetNodeCount(kilnGraph_t graph, size_t* count);

/* ------------------------------------------------------------------------ */
/* Copies                                                                    */
/* ------------------------------------------------------------------------ */

typedef enum kilnMemcpyKind {
  kilnMemcpyHostToHost = 0,
  kilnMemcpyHostToDevice = 1,
  kilnMemcpyDeviceToHost = 2,
  kilnMemcpyDeviceToDevice = 3,
  kilnMemcpyDefault = 4 /* inferred from the pointers */
} kilnMemcpyKind;

/* Copies `count` bytes, ordered on `stream`. Every device range must lie
 * inside one live allocation (else kilnErrorInvalidValue naming the range and
 * the allocation), and the pointers must match `kind`.
 *   - HostToDevice from pageable memory: the source is read before the call
 *     returns (staged), so the caller may reuse it at once. From pinned
 *     memory (kilnMallocHost) the copy is fully asynchronous.
 *   - DeviceToHost into pageable memory: returns after the copy is done
 *     (synchronous, as CUDA). Into pinned memory: asynchronous.
 *   - DeviceToDevice: the source may be on another device (a peer copy); the
 *     caller orders the source device's work (record an event there and make
 *     `stream` wait on it).
 * count 0 is a no-op. A copy that returns only when done (pageable
 * destination, or kilnMemcpy) and was skipped because an earlier task on its
 * stream failed returns that sticky error (see kilnLaunchTask). */
KILN_API kilnError_t kilnMemcpyAsync(void* dst, const void* src, size_t count,
                                    kilnMemcpyKind kind, kilnStream_t stream);

/* As kilnMemcpyAsync on the default stream of the device that owns the device
 * pointer (the destination's for DeviceToDevice, the current device's for
 * HostToHost), then waits for the copy. */
KILN_API kilnError_t kilnMemcpy(void* dst, const void* src, size_t count,
                               kilnMemcpyKind kind);

/* Copies `count` bytes from device srcDevice to device dstDevice, ordered on
 * `stream` (which must belong to dstDevice or srcDevice). */
KILN_API kilnError_t kilnMemcpyPeerAsync(void* dst, int dstDevice,
                                        const void* src, int srcDevice,
                                        size_t count, kilnStream_t stream);

/* Sets `count` bytes of device memory to the byte `value`, ordered on
 * `stream`. */
KILN_API kilnError_t kilnMemsetAsync(void* devPtr, int value, size_t count,
                                    kilnStream_t stream);

/* ------------------------------------------------------------------------ */
/* Activity tracing                                                          */
/* ------------------------------------------------------------------------ */

/*
 * The device side of a profiler, in the spirit of CUPTI's activity API.
 *
 * While tracing is enabled, every unit of device work enqueued from then on —
 * a task, a copy, a memset, an event record or wait — leaves one record with
 * the times it started and ended on its stream, and every runtime call that
 * enqueues work or waits for it (kilnLaunchTask, kilnMemcpy*, kilnMemsetAsync,
 * kilnEventRecord, kilnStreamWaitEvent, kilnStreamSynchronize,
 * kilnDeviceSynchronize, kilnEventSynchronize) leaves one record of kind
 * kilnActivityKindApi with the time it spent on the calling host thread. A
 * profiler collects them with kilnActivityGetRecords.
 *
 * Clock: every timestamp is in nanoseconds on the device clock, the clock that
 * also stamps events (kilnEventElapsedTime is a difference of two of its
 * readings) and that kilnActivityGetTimestamp reads. On the reference device
 * it is the host's monotonic clock, not the wall clock: a profiler that puts
 * device records on a host timeline samples both clocks to convert.
 *
 * Correlation: every such call gets a correlation id, unique in the process,
 * shared by its Api record and the record of the work it enqueued (if any).
 * A client links work to its own host-side operations by pushing external
 * correlation ids on the thread that enqueues the work
 * (kilnActivityPushExternalCorrelationId): every record carries the innermost
 * id of each kind that the enqueueing thread had pushed at the time of the
 * call (0 if none).
 *
 * Lifetime: records stay in the runtime until drained, at most maxRecords of
 * them (kilnActivityEnable); past that, records are dropped and counted
 * (kilnActivityGetDroppedCount). A record is written when its work finishes:
 * work enqueued while tracing was enabled is recorded even if it finishes
 * after kilnActivityDisable; work enqueued before kilnActivityEnable is never
 * recorded. Work skipped because of a sticky stream error leaves no device
 * record (its Api record remains). With KILN_LAUNCH_BLOCKING=1, work runs
 * inside the enqueueing call and is recorded the same way.
 *
 * Cost: with tracing disabled, an enqueueing call pays one relaxed atomic
 * load; nothing is allocated or timed.
 */

/* Largest name length in a record, including the terminating NUL. */
#define KILN_ACTIVITY_NAME_MAX 128
/* Records kept when kilnActivityEnable is given 0. */
#define KILN_ACTIVITY_DEFAULT_MAX_RECORDS (1u << 20)

typedef enum kilnActivityKind {
  kilnActivityKindApi = 0,         /* a runtime call, on the calling host thread */
  kilnActivityKindTask = 1,        /* kilnLaunchTask: the task's fn            */
  kilnActivityKindMemcpyHtoD = 2,  /* host memory to device memory             */
  kilnActivityKindMemcpyDtoH = 3,  /* device memory to host memory             */
  kilnActivityKindMemcpyDtoD = 4,  /* within one device                        */
  kilnActivityKindMemcpyPeer = 5,  /* between two devices                      */
  kilnActivityKindMemcpyHtoH = 6,  /* host to host, ordered on a stream        */
  kilnActivityKindMemset = 7,      /* kilnMemsetAsync                          */
  kilnActivityKindEventRecord = 8, /* an event completed (start == end)        */
  kilnActivityKindEventWait = 9    /* the stream waited for an event; start to
                                      end is the time it was held              */
} kilnActivityKind;

typedef enum kilnExternalCorrelationKind {
  kilnExternalCorrelationKindDefault = 0, /* e.g. the framework operator      */
  kilnExternalCorrelationKindUser = 1     /* e.g. a user-annotated range      */
} kilnExternalCorrelationKind;

typedef struct kilnActivityRecord {
  kilnActivityKind kind;
  int device;                       /* the device of the stream (Api: of the
                                       stream or device the call addressed,
                                       -1 if none)                            */
  unsigned long long streamId;      /* kilnStreamGetId of the stream; 0 for an
                                       Api record that addressed no stream    */
  unsigned long long correlationId; /* see Correlation above                  */
  unsigned long long externalId;     /* innermost Default external id, or 0   */
  unsigned long long userExternalId; /* innermost User external id, or 0      */
  unsigned long long threadId;      /* OS thread id (gettid) of the thread that
                                       made the call                          */
  long long start;                  /* ns on the device clock                 */
  long long end;                    /* ns on the device clock, >= start       */
  size_t bytes;                     /* copies and memsets; 0 otherwise        */
  int srcDevice;                    /* copies: source device, -1 for the host;
                                       -1 for other kinds                     */
  int dstDevice;                    /* copies and memsets: destination device,
                                       -1 for the host; -1 for other kinds    */
  char name[KILN_ACTIVITY_NAME_MAX]; /* NUL-terminated. Task: the launch's
                                       name (truncated; "unnamed task" if
                                       NULL). Api: the function, e.g.
                                       "kilnLaunchTask". Others: CUDA-style,
                                       e.g. "Memcpy HtoD (Pageable -> Device)",
                                       "Memset (Device)", "Event Record"      */
} kilnActivityRecord;

/* Starts a new collection: discards records not yet drained (including those
 * of work still in flight from an earlier collection), resets the dropped
 * count, and records work enqueued from now on, keeping at most `maxRecords`
 * undrained records (0: KILN_ACTIVITY_DEFAULT_MAX_RECORDS). Enabling while
 * enabled starts a new collection the same way. */
KILN_API kilnError_t kilnActivityEnable(size_t maxRecords);

/* Stops recording work enqueued from now on. Work already enqueued while
 * tracing was enabled still writes its record when it finishes. No-op when
 * tracing is disabled. */
KILN_API kilnError_t kilnActivityDisable(void);

/* Blocks until every piece of work enqueued while tracing was enabled has
 * finished and written its record (or been skipped), so that a following
 * kilnActivityGetRecords sees them all. It does not synchronize in the CUDA
 * sense: sticky errors are left to the streams. Fails with
 * kilnErrorNotPermitted when called from a task (it could wait for the task
 * itself). */
KILN_API kilnError_t kilnActivityFlushAll(void);

/* Moves up to `capacity` of the oldest undrained records into `records`, in
 * the order they were written, and sets *count to how many. capacity 0 with
 * records NULL just sets *count to the number available. */
KILN_API kilnError_t kilnActivityGetRecords(kilnActivityRecord* records, size_t capacity,
                                           size_t* count);

/* Records dropped in the current collection because maxRecords undrained
 * records were already kept. */
KILN_API kilnError_t kilnActivityGetDroppedCount(size_t* dropped);

/* Pushes `id` on the calling thread's stack of external correlation ids of
 * `kind`; records of calls this thread makes until the matching pop carry it
 * (if it is still the innermost). Works whether or not tracing is enabled.
 * kilnErrorInvalidValue for an unknown kind. */
KILN_API kilnError_t kilnActivityPushExternalCorrelationId(kilnExternalCorrelationKind kind,
                                                          unsigned long long id);

/* Pops the innermost id of `kind` pushed by the calling thread and stores it
 * in *lastId (if not NULL). kilnErrorInvalidValue if the stack is empty. */
KILN_API kilnError_t kilnActivityPopExternalCorrelationId(kilnExternalCorrelationKind kind,
                                                         unsigned long long* lastId);

/* The device clock now, in nanoseconds (the clock of activity records and
 * event timestamps). */
KILN_API kilnError_t kilnActivityGetTimestamp(long long* timestamp);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KILN_RUNTIME_H_ */
