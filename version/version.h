// The version of this build, baked in when it was compiled: the project
// version from CMakeLists.txt and what `git describe --tags --always --dirty`
// said about the source tree at build time (regenerated on every build, so a
// new commit or a dirty tree shows up without re-running CMake). A tree
// without git metadata (a Docker build context, a tarball) reports "unknown"
// as its revision.
//
// Thread safety: the functions return pointers to static strings.
#ifndef TQKV_VERSION_VERSION_H_
#define TQKV_VERSION_VERSION_H_

namespace tqkv {

// "0.1.0": project(tqkv VERSION ...) in the top-level CMakeLists.txt.
const char* ProjectVersion();
// "dcb5c6a", "v0.2.0-3-g1a2b3c4-dirty", or "unknown" without git metadata.
const char* GitRevision();
// "0.1.0 (git dcb5c6a)": what --version prints and GetServerInfo reports.
const char* VersionLine();

}  // namespace tqkv

#endif  // TQKV_VERSION_VERSION_H_
